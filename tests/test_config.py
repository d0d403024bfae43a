"""Bad settings: one line naming the setting, exit 2, before any process group."""

import os
import re
import subprocess
import sys

import pytest

from hybrid2d import recipes
from hybrid2d.cli import apply_overrides
from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import LAUNCHER_MESH_ENV, check_before_torch
from hybrid2d.layout import RunLayout
from tests.launch import REPO


def run_cli(*args, world=1, local_world=None, timeout=60, python_flags=()):
    env = dict(
        os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_WORLD_SIZE=str(local_world or world)
    )
    env.pop("MASTER_ADDR", None)
    return subprocess.run(
        [sys.executable, *python_flags, "recipes/llama.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, proc.stdout + proc.stderr  # README: bad settings exit 2
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, world, expect",
    [
        (["--parallel.tp", "3", "--parallel.dp_shard", "1"], 3, "model.n_heads"),
        (["--parallel.tp", "2", "--parallel.dp_shard", "3"], 4, "world size 4"),
        (["--parallel.tp", "3"], 4, "world size 4"),
        (
            [
                "--parallel.tp",
                "4",
                "--model.n_kv_heads",
                "6",
                "--model.n_heads",
                "12",
                "--model.dim",
                "384",
            ],
            4,
            "tp=4 does not divide model.n_kv_heads=6 (nor is it a multiple of it); "
            "use tp in [1, 2]",
        ),
        (["--parallel.tp", "2", "--model.ffn_dim", "689"], 2, "model.ffn_dim"),
        (["--model.dim", "24", "--model.n_heads", "8"], 1, "odd head size"),
        (["--parallel.tp", "2", "--model.vocab_size", "4095"], 2, "model.vocab_size"),
        (["--parallel.tp", "2", "--train.seq_len", "255"], 2, "train.seq_len"),
        (["--train.global_batch", "6"], 4, "train.global_batch"),
        (["--train.micro_batch", "3"], 2, "train.micro_batch"),
        (["--train.stepz", "5"], 1, "--train.steps"),
        (["--train.steps", "five"], 1, "--train.steps"),
        (["--recipe", "llama3-8b"], 1, "llama3.1-8b"),
        (["--data.path", "/nonexistent/corpus.txt", "--train.steps", "1"], 1, "data.path"),
        (
            ["--parallel.shm_collectives", "yes"],
            1,
            "--parallel.shm_collectives: 'yes' is not one of auto, on, off",
        ),
    ],
)
def test_bad_setting_is_one_line(args, world, expect):
    line = error_line(run_cli(*args, world=world))
    assert expect in line


DATA_HINT = "use a .txt/.jsonl/.parquet file, a directory of them, or '' for the built-in corpus"


@pytest.mark.parametrize(
    "args, world, expect",
    [
        (
            ["--parallel.tp", "3"],
            4,
            "world size 4 is not divisible by parallel.dp_replicate x parallel.tp = 1 x 3; "
            "pick tp among [1, 2, 4]",
        ),
        (
            ["--checkpoint.init_from", "foo:bar"],
            1,
            "checkpoint.init_from='foo:bar' is not 'hf:PATH' (a Hugging Face model directory) "
            "or 'dcp:PATH' (a DCP checkpoint directory)",
        ),
        (
            ["--checkpoint.init_from", "hf:{tmp}/nope"],
            1,
            "checkpoint.init_from=hf:{tmp}/nope: {tmp}/nope is not a directory (expected a "
            "Hugging Face model dir)",
        ),
        (
            ["--checkpoint.init_from", "dcp:{tmp}/bad.json"],
            1,
            "checkpoint.init_from=dcp:{tmp}/bad.json: {tmp}/bad.json is not a directory "
            "(expected a DCP checkpoint directory)",
        ),
        (
            ["--checkpoint.resume", "{tmp}/nope"],
            1,
            "--checkpoint.resume='{tmp}/nope': {tmp}/nope does not exist; pass a checkpoint step "
            "directory (runs/<run>/checkpoints/step-0000100), a run directory, or 'auto'",
        ),
        (
            ["--checkpoint.resume", "{tmp}/bad.json"],
            1,
            "--checkpoint.resume='{tmp}/bad.json': {tmp}/bad.json is a file, not a checkpoint "
            "directory; pass a step directory (runs/<run>/checkpoints/step-0000100) or a run "
            "directory",
        ),
        (
            ["--data.path", "{tmp}/nope.txt"],
            1,
            f"data.path='{{tmp}}/nope.txt' does not exist; {DATA_HINT}",
        ),
        (
            ["--data.path", "{tmp}/bad.json"],
            1,
            f"data.path='{{tmp}}/bad.json' has unsupported suffix '.json'; {DATA_HINT}",
        ),
        (
            ["--data.val_path", "{tmp}/nope"],
            1,
            f"data.val_path='{{tmp}}/nope' does not exist; {DATA_HINT}",
        ),
        (
            ["--data.tokenizer", "{tmp}"],
            1,
            "data.tokenizer='{tmp}': {tmp}/tokenizer.json does not exist; use a tokenizer.json, "
            "a Hugging Face model directory holding one, or '' to train a BPE",
        ),
        (
            ["--parallel.plan_hardware", "{tmp}/bad.json"],
            1,
            "parallel.plan_hardware='{tmp}/bad.json': --hardware {tmp}/bad.json: not JSON "
            "(Expecting property name enclosed in double quotes, line 1)",
        ),
        (
            ["--parallel.plan_hardware", "{tmp}/nope.json"],
            1,
            "parallel.plan_hardware='{tmp}/nope.json': --hardware {tmp}/nope.json: No such file "
            "or directory",
        ),
    ],
    ids=[
        "mesh",
        "init_from-malformed",
        "init_from-hf-missing",
        "init_from-dcp-file",
        "resume-missing",
        "resume-file",
        "data-missing",
        "data-suffix",
        "val_path-missing",
        "tokenizer-missing",
        "plan_hardware-not-json",
        "plan_hardware-missing",
    ],
)
def test_what_the_command_line_shows_fails_before_torch_is_imported(args, world, expect, tmp_path):
    """A size that does not fit the world, or a path a setting names that is malformed, missing
    or unreadable, fails in the recipe with the line the run would print later, before torch
    loads (4 to 13 s of a launch), as settings checked alone do."""
    (tmp_path / "bad.json").write_text("{not json")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = run_cli(*args, world=world, python_flags=("-X", "importtime"))
    assert error_line(proc) == "error: " + expect.format(tmp=tmp_path)
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if "|" in ln]
    assert "hybrid2d.config" in imported and "torch" not in imported


def test_paths_that_exist_pass_the_check_before_torch(tmp_path, monkeypatch):
    """A data directory, a tokenizer's HF directory, resume auto, an init_from directory and a
    profile file are not refused: the check refuses only what the run would."""
    for env in ("WORLD_SIZE", *LAUNCHER_MESH_ENV):
        monkeypatch.delenv(env, raising=False)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "profile.json").write_text("{}")  # its fields are the planner's to check
    cfg = recipes.get("llama-debug")
    cfg.data.path, cfg.data.val_path = str(tmp_path / "corpus"), str(tmp_path / "corpus" / "a.txt")
    cfg.data.tokenizer, cfg.checkpoint.resume = str(tmp_path), "auto"
    cfg.parallel.plan_hardware = str(tmp_path / "profile.json")
    check_before_torch(cfg, set())
    cfg.checkpoint.init_from, cfg.checkpoint.resume = f"hf:{tmp_path}", str(tmp_path)
    check_before_torch(cfg, set())


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"--parallel\.tp"):
        apply_overrides(JobConfig(), ["--parallel.tpp", "2"])


def test_overrides_set_typed_values():
    cfg = JobConfig()
    changed = apply_overrides(
        cfg, ["--parallel.tp", "2", "--train.lr=0.5", "--checkpoint.async_save", "true"]
    )
    assert (cfg.parallel.tp, cfg.train.lr, cfg.checkpoint.async_save) == (2, 0.5, True)
    assert changed == {"parallel.tp", "train.lr", "checkpoint.async_save"}


def test_tp_spanning_nodes_warns(monkeypatch):
    from hybrid2d.mesh import tp_locality_warning

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "spans nodes" in tp_locality_warning(4)
    assert tp_locality_warning(2) is None


def test_tp_hint_lists_only_sizes_that_pass_every_check():
    """llama3.1-70b (64 heads, 8 kv heads) on 48 ranks: tp 16 is offered (2 ranks per kv head),
    tp 3 and 6 divide the world but not the heads; on 6 ranks tp 4 does not divide the world."""
    for world, tp, offered in ((48, 48, [1, 2, 4, 8, 16]), (6, 3, [1, 2])):
        cfg = recipes.get("llama3.1-70b")
        cfg.parallel.tp, cfg.parallel.dp_shard = tp, world // tp
        with pytest.raises(ConfigError, match=re.escape(f"use tp in {offered}")):
            RunLayout.build(cfg, world)


def test_list_shows_recipes_with_sizes():
    proc = run_cli("--list")
    assert proc.returncode == 0
    for name, size in [
        ("llama-debug", "5.0M"),
        ("llama3.2-1b", "1.24B"),
        ("llama3.1-8b", "8.03B"),
        ("llama3.1-70b", "70.55B"),
    ]:
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(name + " "))
        assert size in line and "tp=" in line


def test_published_shapes_fit_tp8():
    """tp=8 (one node) divides heads, kv heads, ffn and vocabulary of the published shapes."""
    for name in ("llama3.1-8b", "llama3.1-70b"):
        cfg = recipes.get(name)
        cfg.parallel.tp, cfg.train.micro_batch = 8, 0
        assert RunLayout.build(cfg, 64).mesh_shape == (1, 8, 8)


# ---- the command line through tyro: every setting, its range, one error line -----------------

import importlib.util  # noqa: E402
import math  # noqa: E402
import typing  # noqa: E402

from hybrid2d import cli  # noqa: E402
from hybrid2d import config as config_mod  # noqa: E402
from hybrid2d.config import LIMITS, setting_names  # noqa: E402


def _load_recipe_main():
    spec = importlib.util.spec_from_file_location("recipe_llama", REPO / "recipes" / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


recipe_main = _load_recipe_main()


def _kinds() -> dict[str, object]:
    cfg = JobConfig()
    out = {}
    for name in setting_names(cfg):
        section, field_name = name.split(".")
        out[name] = typing.get_type_hints(type(getattr(cfg, section)))[field_name]
    return out


def _main_error(capsys, monkeypatch, *args) -> str:
    """Run recipes/llama.py's main in this process; it must exit 2 with one `error:` line."""
    monkeypatch.delenv("RANK", raising=False)
    code = recipe_main(list(args))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_every_number_setting_has_a_range():
    numbers = {n for n, k in _kinds().items() if k in (int, float)}
    assert numbers == set(LIMITS), numbers ^ set(LIMITS)


def _bad_values() -> list[tuple[str, str]]:
    """(setting, value) pairs that must each be refused: non-finite floats, values just
    outside each range, the examples the issue names."""
    out = []
    for name, kind in _kinds().items():
        if kind is float:
            out += [(name, "nan"), (name, "inf"), (name, "-inf")]
        limit = LIMITS.get(name)
        if limit is not None and limit.lo is not None:
            below = limit.lo - (1 if kind is int else 1e-3) if not limit.lo_open else limit.lo
            if below not in limit.also:
                out.append((name, str(below)))
        if limit is not None and limit.hi is not None:
            above = limit.hi if limit.hi_open else limit.hi + (1 if kind is int else 1e-3)
            out.append((name, str(above)))
    out += [
        ("train.lr", "0"),
        ("train.lr", "-3e-4"),
        ("train.grad_clip", "-1"),
        ("train.beta1", "1.0"),
        ("train.beta2", "-0.1"),
        ("train.weight_decay", "-0.1"),
        ("train.min_lr_ratio", "1.5"),
        ("train.warmup_steps", "-1"),
        ("train.steps", "0"),
        ("parallel.timeout_s", "0"),
        ("parallel.dp_shard", "-2"),
        ("train.steps", "1.5"),
        ("train.lr", "fast"),
        ("parallel.tp", "two"),
    ]
    return out


@pytest.mark.parametrize("name, value", _bad_values())
def test_bad_number_is_one_line_exit_2(capsys, monkeypatch, name, value):
    line = _main_error(capsys, monkeypatch, "--" + name, value)
    shown = [value] + ([str(float(value))] if value.replace(".", "").lstrip("-").isdigit() else [])
    shown += [str(float(value))] if "e" in value else []
    assert name in line and any(s in line for s in shown), line


def test_bad_number_in_a_recipe_is_one_line_before_training(capsys, monkeypatch):
    cfg = recipes.get("llama-debug")
    cfg.train.lr = math.nan
    with pytest.raises(
        ConfigError, match=r"^train\.lr=nan is not a finite number; use a value > 0$"
    ):
        RunLayout.build(cfg, 1)


@pytest.mark.parametrize(
    "name", [n for n, k in _kinds().items() if typing.get_origin(k) is typing.Literal]
)
def test_enumerated_settings_name_their_choices(capsys, monkeypatch, name):
    choices = typing.get_args(_kinds()[name])
    line = _main_error(capsys, monkeypatch, f"--{name}", "bogus")
    assert f"--{name}" in line and "'bogus'" in line, line
    assert "is not one of " + ", ".join(choices) in line, line


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--train.stepz", "5"], "did you mean --train.steps?"),
        (["--lr", "0.1"], "did you mean --train.lr?"),
        (["--model.lr", "0.1"], "did you mean --train.lr?"),
        (["--train.learning_rate", "0.1"], "unknown setting --train.learning_rate"),
        (["--parallel.mixed_precison", "bf16"], "did you mean --parallel.mixed_precision?"),
        (["--train.lr"], "Missing value for argument '--train.lr'"),
        (["train.lr", "1"], "unexpected argument 'train.lr'"),
        (["--recipe"], "--recipe"),
        (["--parallel.compile", "maybe"], "--parallel.compile: 'maybe' is not true or false"),
        (["--train.steps", "7", "9"], "unexpected argument '9'"),
    ],
)
def test_cli_mistakes_are_one_line(capsys, monkeypatch, args, expect):
    assert expect in _main_error(capsys, monkeypatch, *args)


def test_booleans_take_true_false_and_bare_flags():
    cfg = JobConfig()
    assert cfg.parallel.reshard_after_forward and not cfg.parallel.compile
    changed = apply_overrides(
        cfg,
        [
            "--parallel.reshard_after_forward",
            "false",
            "--parallel.compile",
            "--metrics.tensorboard=False",
            "--checkpoint.async_save",
            "TRUE",
        ],
    )
    assert changed == {
        "parallel.reshard_after_forward",
        "parallel.compile",
        "metrics.tensorboard",
        "checkpoint.async_save",
    }
    p = cfg.parallel
    assert (p.reshard_after_forward, p.compile) == (False, True)
    assert (cfg.metrics.tensorboard, cfg.checkpoint.async_save) == (False, True)


def test_the_end_of_flags_marker_is_no_setting():
    """'--' was taken for a setting with an empty name: an AttributeError traceback."""
    cfg = JobConfig()
    assert apply_overrides(cfg, ["--parallel.compile", "--"]) == {"parallel.compile"}
    assert cfg.parallel.compile


def test_overrides_keep_the_recipe_values_they_do_not_name():
    cfg = recipes.get("llama3.1-8b")
    before = cfg.to_dict()
    assert apply_overrides(cfg, ["--train.steps", "7", "--parallel.dp_shard", "-1"]) == {
        "train.steps",
        "parallel.dp_shard",
    }
    after = cfg.to_dict()
    assert after["train"].pop("steps") == 7 and before["train"].pop("steps") == 1000
    assert after == before


def test_help_lists_every_setting_with_help_and_recipe_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # one column of settings
    assert recipe_main(["--recipe", "llama3.1-8b", "--help"]) == 0
    text = capsys.readouterr().out
    cfg = recipes.get("llama3.1-8b")
    blocks: dict[str, str] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip(" │")
        if line.startswith("--"):
            current = line.split()[0]
            blocks[current] = line
        elif current:
            blocks[current] += " " + line
    for name in setting_names(cfg):
        section, field_name = name.split(".")
        block = blocks.get("--" + name)
        assert block is not None, f"--{name} missing from --help"
        value = getattr(getattr(cfg, section), field_name)
        shown = next(
            (f"(default: {v})" for v in (value, repr(value)) if f"(default: {v})" in block), None
        )
        assert shown, block
        helptext = block.split(maxsplit=2)[-1].replace(shown, "").strip()
        assert len(helptext) > 3, f"--{name} has no help text: {block!r}"
    assert "{auto,bf16,fp32}" in blocks["--parallel.mixed_precision"]


def test_tyro_errors_become_one_config_error(capsys):
    with pytest.raises(ConfigError) as e:
        apply_overrides(JobConfig(), ["--train.steps=x"])
    assert str(e.value) == "--train.steps: 'x' is not a whole number"
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.steps", "3.5"], "--train.steps: '3.5' is not a whole number"),
        (["--train.lr", "1e-3x"], "--train.lr: '1e-3x' is not a number"),
        (
            ["--parallel.activation_checkpoint", "fulll"],
            "--parallel.activation_checkpoint: 'fulll' is not one of none, full, selective; "
            "did you mean full?",
        ),
    ],
)
def test_values_of_the_wrong_kind_read_as_one_plain_line(args, message):
    """Python's own wording (`invalid literal for int() with base 10`) and tyro's choice
    message gave way to the project's form, with the closest choice where one is close."""
    with pytest.raises(ConfigError) as e:
        apply_overrides(JobConfig(), args)
    assert str(e.value) == message


def test_whole_numbers_may_be_written_in_exponent_form():
    cfg = JobConfig()
    apply_overrides(cfg, ["--train.steps", "1e3", "--train.lr", "2e-4"])
    assert (cfg.train.steps, cfg.train.lr) == (1000, 2e-4)
    assert type(cfg.train.steps) is int


def test_tyro_error_text_framed_or_plain():
    """tyro frames its error on a terminal and writes it plain otherwise; a long message wraps."""
    framed = """\
╭─ Invalid choice ─────────────────────────────────────╮
│ invalid choice 'yes' for argument                    │
│ '--parallel.shm_collectives'.                        │
│ ──────────────────────────────────────────────────── │
│ For full helptext, run recipes/llama.py --help       │
╰──────────────────────────────────────────────────────╯
"""
    plain = """\
 Invalid choice
 ---------------------------------------------
  invalid choice 'yes' for argument
  '--parallel.shm_collectives'.

 For full helptext, run recipes/llama.py --help
"""
    want = "invalid choice 'yes' for argument '--parallel.shm_collectives'."
    assert cli._tyro_error(framed) == cli._tyro_error(plain) == want


# ---- config.json: unknown keys, retired keys ------------------------------------------------


def test_from_dict_round_trips():
    cfg = recipes.get("llama3.1-70b")
    assert JobConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "d, expect",
    [
        ({"parallel": {"tpp": 2}}, r"'parallel\.tpp'.*closest valid one is 'parallel\.tp'"),
        ({"trian": {"lr": 0.1}}, r"'trian'.*closest valid one is 'train'"),
        ({"train": {"lr": "fast"}}, r"train\.lr='fast' is not a number"),
        ({"train": {"optimizer": "adam"}}, r"train\.optimizer='adam' is not one of"),
        ({"train": 3}, r"section 'train'"),
    ],
)
def test_from_dict_rejects_unknown_or_mistyped_keys(d, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        JobConfig.from_dict(d)
    assert "\n" not in str(e.value)


def test_from_dict_accepts_retired_keys_of_old_checkpoints():
    old = JobConfig().to_dict()
    for key in config_mod.RETIRED_KEYS:
        section, name = key.split(".")
        old[section][name] = False
    cfg = JobConfig.from_dict(old)  # no error whether or not the fields still exist
    for key in config_mod.RETIRED_KEYS:
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name, False) is False


def test_retired_key_after_its_field_is_gone(monkeypatch, capsys):
    """What happens once a retired field is removed (simulated with a name that never was)."""
    monkeypatch.setattr(config_mod, "RETIRED_KEYS", (*config_mod.RETIRED_KEYS, "train.old_knob"))
    d = JobConfig().to_dict()
    d["train"]["old_knob"] = 3
    assert JobConfig.from_dict(d) == JobConfig()
    line = _main_error(capsys, monkeypatch, "--train.old_knob", "3")
    assert "--train.old_knob was removed" in line


@pytest.mark.parametrize("key", config_mod.RETIRED_KEYS)
def test_retired_keys_on_the_command_line(capsys, monkeypatch, key):
    """A retired setting is an ordinary one while its field exists, then an error naming it."""
    if key in setting_names():
        cfg = JobConfig()
        assert apply_overrides(cfg, [f"--{key}", "false"]) == {key}
    else:
        assert f"--{key} was removed" in _main_error(capsys, monkeypatch, f"--{key}", "true")


def test_a_refused_launch_leaves_an_earlier_runs_config_json_alone(tmp_path):
    """A launch into an existing run dir that fails its checks (here: a data directory without
    data files, which only the run finds) exits 2 with one line and does not rewrite the earlier
    run's config.json. Without --checkpoint.resume, an earlier run's dir with no checkpoint is
    refused first (it was written over)."""
    run = tmp_path / "run"
    run.mkdir()
    earlier = '{"earlier": "run"}'
    (run / "config.json").write_text(earlier)
    line = error_line(run_cli("--metrics.run_dir", str(run), timeout=120))
    assert f"metrics.run_dir={run} holds an earlier run (config.json)" in line, line
    (tmp_path / "no_data").mkdir()
    proc = run_cli(
        "--data.path", str(tmp_path / "no_data"), "--metrics.run_dir", str(run),
        "--checkpoint.resume", "auto", timeout=120,
    )  # fmt: skip
    assert "no_data' is a directory without any" in error_line(proc)
    assert (run / "config.json").read_text() == earlier


def test_a_refused_launch_leaves_no_empty_run_dir(tmp_path):
    """A run dir the launch made is removed again when the launch is refused (it held only the
    lock); its parent, which existed, stays. (Missing data is refused before the run dir is
    made; a data directory without data files only the run finds.)"""
    run = tmp_path / "runs" / "new"
    (tmp_path / "no_data").mkdir()
    proc = run_cli(
        "--data.path", str(tmp_path / "no_data"), "--metrics.run_dir", str(run), timeout=120
    )
    assert "no_data' is a directory without any" in error_line(proc)
    assert not run.exists() and (tmp_path / "runs").is_dir()


@pytest.mark.slow
def test_torchrun_config_error_prints_its_line_whichever_rank_exits_first():
    """Every rank finds the same bad mesh; rank 0 prints it. Other ranks used to exit at once,
    and torchrun, seeing one of them fail first, could stop rank 0 before its line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "4",
            "recipes/llama.py",
            "--parallel.tp",
            "3",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0
    assert len(lines) == 1 and "parallel.tp" in lines[0], proc.stderr[-3000:]


def test_training_afresh_beside_another_runs_checkpoints_is_refused(tmp_path):
    """Without --checkpoint.resume, a run dir that holds checkpoints is not trained into again
    from step 0 (its checkpoints/ would mix two runs): one line naming both ways out."""
    from tests.test_faults import SMALL  # a small model on less text: the runs' size is no part

    run = ["--metrics.run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "c")]
    first = run_cli(*SMALL, *run, "--train.steps", "2", timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(*SMALL, *run, "--train.steps", "4", timeout=120)
    line = error_line(again)
    assert "already holds checkpoints (latest step-0000002)" in line, line
    assert "--checkpoint.resume auto" in line
    resumed = run_cli(
        *SMALL, *run, "--train.steps", "4", "--checkpoint.resume", "auto", timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_run_whose_planned_peak_exceeds_the_hosts_memory_is_refused_before_building():
    """llama-debug with one micro batch of 8,192 sequences plans 260 GiB a rank, more than this
    host has: one line naming the ways out, exit 2, in seconds (it used to build data and die
    allocating, or meet the OOM killer)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    batch = ["--train.global_batch", "8192", "--train.micro_batch", "8192"]
    cfg = recipes.get("llama-debug")
    apply_overrides(cfg, batch)
    from hybrid2d.planner.memory import estimate

    assert estimate(cfg, RunLayout.build(cfg, 1), target="cpu").peak > ram  # the premise
    line = error_line(run_cli(*batch, "--train.steps", "1", timeout=120))
    assert "more than this host's RAM" in line and "--parallel.check_memory false" in line


@pytest.mark.parametrize(
    "settings,words",
    [
        (["--train.seq_len", "4096"], "train.seq_len=4096 is longer than model.max_position"),
        (["--train.seq_len", "2048"], None),
        (["--train.steps", "4", "--checkpoint.stop_after", "9"], "checkpoint.stop_after=9 is not"),
        (["--train.steps", "4", "--checkpoint.stop_after", "4"], "checkpoint.stop_after=4 is not"),
        (["--train.steps", "4", "--checkpoint.stop_after", "3"], None),
    ],
)
def test_settings_that_would_be_ignored_or_outgrow_the_model_are_refused(settings, words):
    """A sequence longer than the positions the model is built for trained silently (and its
    export said the shorter length); a stop_after at or past the last step was ignored."""
    cfg = JobConfig()  # llama-debug: max_position_embeddings 2048
    apply_overrides(cfg, settings)
    if words is None:
        RunLayout.build(cfg, 1)
        return
    with pytest.raises(ConfigError, match=re.escape(words)):
        RunLayout.build(cfg, 1)
