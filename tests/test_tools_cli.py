"""The tools' command lines (hybrid2d/cli.py): a bad argument is one `error:` line and exit 2,
sizes must be positive, an estimate writes no file unless asked, and generate.py's length is
bounded by the model's positions. Everything runs in this process (no checkpoint training)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hybrid2d.cli import positive_size
from hybrid2d.errors import ConfigError
from tests.launch import REPO

TOOLS = [
    "generate",
    "memory_report",
    "convert_hf_to_dcp",
    "convert_dcp_to_hf",
    "export_checkpoint",
    "plan",
    "run_report",
    "tokenize_corpus",
]


def tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call(capsys, name, argv):
    """(exit code, stdout, stderr) of the tool's main(argv), whether it returns or exits."""
    mod = tool(name)
    capsys.readouterr()
    try:
        code = mod.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---- one parser, one error line ---------------------------------------------------------------

BAD = {
    "generate": (["ckpt", "--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    "memory_report": (["--mesh", "2x2", "--target", "tpu"], "invalid choice: 'tpu'"),
    "convert_hf_to_dcp": (["src"], "the following arguments are required: dst"),
    "convert_dcp_to_hf": (["src", "dst", "--bogus"], "unrecognized arguments: --bogus"),
    "export_checkpoint": (["ckpt"], "the following arguments are required: out"),
    "plan": (["--nodes", "x"], "argument --nodes: invalid int value: 'x'"),
    "run_report": (["--out", "x.html"], "the following arguments are required: --run-dir"),
    "tokenize_corpus": (["--data.path", "x"], "required: --data.tokenizer, --out"),
}


@pytest.mark.parametrize("name", TOOLS)
def test_bad_arguments_are_one_error_line_and_exit_2(capsys, name):
    """argparse's default printed its usage block (4-6 lines) before the error in all but
    plan.py."""
    argv, what = BAD[name]
    code, _, err = call(capsys, name, argv)
    assert code == 2
    assert what in one_error_line(err)


@pytest.mark.parametrize("typed", [["--train.steps", "10"], ["--train.steps=10"]])
def test_a_trainer_setting_typed_as_for_the_recipe_points_at_set(capsys, typed):
    """memory_report.py takes --train.steps 10, plan.py --set train.steps=10: its error says so."""
    code, _, err = call(capsys, "plan", ["--recipe", "llama-debug", *typed])
    assert code == 2
    assert one_error_line(err).endswith("takes recipe settings as --set train.steps=10"), err


@pytest.mark.parametrize("name", TOOLS)
def test_help_still_prints_the_whole_usage(capsys, name):
    code, out, err = call(capsys, name, ["--help"])
    assert code == 0 and not err
    assert out.startswith("usage: ") and "options:" in out and "-h, --help" in out


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_uses_the_shared_parser(name):
    source = (REPO / "tools" / f"{name}.py").read_text()
    assert "from hybrid2d.cli import OneLineParser" in source
    assert "ArgumentParser(" not in source and "class OneLineParser" not in source


ENTRY_POINTS = sorted(
    p.relative_to(REPO) for p in [*REPO.glob("tools/*.py"), REPO / "recipes/llama.py"]
)


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=str)
def test_entry_points_parse_with_the_one_parser_and_do_not_edit_sys_path(path):
    """bench.py and bench_worker.py had argparse's own parser, recipes/llama.py a second
    subclass, and every one of them put the checkout on sys.path (`pip install -e .` does)."""
    source = (REPO / path).read_text()
    assert "sys.path" not in source
    assert "ArgumentParser(" not in source and "class OneLineParser" not in source
    assert "import OneLineParser" in source or "OneLineParser," in source


def test_the_parser_touches_no_private_part_of_argparse():
    """OneLineParser set argparse's private `_negative_number_matcher` and read its private
    `_option_string_actions`; it now joins '-5GiB' to its option and keeps its own table."""
    source = (REPO / "hybrid2d" / "cli.py").read_text()
    assert "_negative_number_matcher" not in source and "_option_string_actions" not in source


def test_the_benchmark_refuses_in_one_line(capsys):
    """tools/bench.py printed argparse's usage block before the error."""
    code, _, err = call(capsys, "bench", ["--mesh"])
    assert code == 2
    assert one_error_line(err) == "error: argument --mesh: expected one argument"


@pytest.mark.parametrize(
    "script", [["tools/convert_hf_to_dcp.py", "--help"], ["recipes/llama.py", "--list"]]
)
def test_scripts_run_from_any_working_directory(tmp_path, script):
    """Without the sys.path edit a script finds hybrid2d as installed (here: PYTHONPATH)."""
    path, *argv = script
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(REPO / path), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout and not out.stderr, out.stderr


# ---- sizes ------------------------------------------------------------------------------------

SIZE_FLAGS = {
    "memory_report": (["--mesh", "2x2"], "--device-memory"),
    "plan": ([], "--gpu-memory"),
    "convert_dcp_to_hf": (["src", "dst"], "--max-shard-size"),
    "export_checkpoint": (["ckpt", "out"], "--max-shard-size"),
}


@pytest.mark.parametrize("name", sorted(SIZE_FLAGS))
@pytest.mark.parametrize("value, joined", [("-5GiB", False), ("-5GiB", True), ("0", False)])
def test_a_negative_or_zero_size_is_one_line_naming_the_option(capsys, name, value, joined):
    """'--device-memory -5GiB' was 'expected one argument' (argparse took -5GiB for an option);
    '--device-memory=-5GiB' said it was no size at all, and 0 that it was 0 bytes."""
    argv, flag = SIZE_FLAGS[name]
    given = [f"{flag}={value}"] if joined else [flag, value]
    code, _, err = call(capsys, name, argv + given)
    assert code == 2
    expected = f"error: {flag}: '{value}' is not a positive size (e.g. 80GiB, 80GB)"
    assert one_error_line(err) == expected


def test_positive_size():
    assert positive_size("80GiB", "--x") == 80 * 2**30
    assert positive_size(" 1.5kB ", "--x") == 1500
    for bad in ("-1", "-0.5GB", "0.5", "0GiB"):
        with pytest.raises(ConfigError, match="is not a positive size"):
            positive_size(bad, "--x")
    for bad in ("80G", "-80G", "lots", "-"):  # no size at all: the size parser's message
        with pytest.raises(ConfigError, match=r"--x '.*' is not a size: use bytes"):
            positive_size(bad, "--x")


# ---- memory_report: files only when asked -----------------------------------------------------


def test_memory_report_estimate_writes_files_only_when_asked(tmp_path, monkeypatch, capsys):
    """An estimate used to leave runs/memory-RECIPE-TIME/ in the current directory."""
    monkeypatch.chdir(tmp_path)
    argv = ["--recipe", "llama-debug", "--mesh", "2x2", "--target", "cpu"]
    code, out, err = call(capsys, "memory_report", argv)
    assert code == 0, err
    assert list(tmp_path.iterdir()) == []
    assert "llama-debug on mesh 2x2" in out and "--out DIR" in out
    code, out, err = call(capsys, "memory_report", argv + ["--out", "rep"])
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "memory_report.html",
        "memory_report.md",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["rep"]


# ---- generate: bounded length -----------------------------------------------------------------

POSITIONS = 256  # tests/workers/hf_chat.py's max_position_embeddings


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.workers.hf_chat import make_chat_model

    path = tmp_path_factory.mktemp("chat") / "hf"
    make_chat_model(str(path))
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == POSITIONS
    return path


def prompt_tokens(path, text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_generate_refuses_fewer_than_one_new_token(tmp_path, capsys, value):
    """Checked before the checkpoint is looked at (tmp_path holds none)."""
    code, _, err = call(capsys, "generate", [str(tmp_path), "--max-new-tokens", value])
    assert code == 2
    assert one_error_line(err) == f"error: --max-new-tokens {value} must be >= 1"


def test_generate_bounds_prompt_and_new_tokens_by_the_model_positions(
    chat_model, monkeypatch, capsys
):
    """100,000 new tokens ran on for minutes (the model has no KV cache; past its positions the
    context slid). Now prompt + new tokens beyond max_position_embeddings is one line, before the
    weights are read; exactly max_position_embeddings runs."""
    from hybrid2d.checkpoint import standalone

    n = prompt_tokens(chat_model, "def ")
    load_model = standalone.load_model

    def no_weights(*a, **k):
        raise AssertionError("the weights were read before the length was checked")

    monkeypatch.setattr(standalone, "load_model", no_weights)
    for new in (POSITIONS - n + 1, 100_000):
        code, out, err = call(capsys, "generate", [str(chat_model), "--prompt", "def ",
                                                   "--max-new-tokens", str(new)])  # fmt: skip
        assert code == 2 and not out
        line = one_error_line(err)
        assert line.startswith(f"error: --max-new-tokens {new}: {n} prompt tokens")
        assert f"built for {POSITIONS} positions" in line and f"at most {POSITIONS - n}" in line

    long = "What is the answer? " * 60
    assert prompt_tokens(chat_model, long) > POSITIONS
    code, _, err = call(capsys, "generate", [str(chat_model), "--prompt", long])
    assert code == 2 and "shorten it" in one_error_line(err)

    monkeypatch.setattr(standalone, "load_model", load_model)
    argv = [str(chat_model), "--prompt", "def ", "--max-new-tokens", str(POSITIONS - n)]
    code, out, err = call(capsys, "generate", argv + ["--no-stop", "--json"])
    assert code == 0, err
    assert len(json.loads(out)["ids"]) == POSITIONS - n


# ---- run_and_exit: the exit status, the output and later atexit handlers survive the fast exit --

EXITING = """
import atexit, sys
from hybrid2d.cli import run_and_exit

def main():
    atexit.register(lambda: open(sys.argv[2], "w").write("ran"))  # like torch's, registered later
    print("out", flush=False)
    print("err", file=sys.stderr, flush=False)
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
    if sys.argv[1] == "exit":
        sys.exit(3)
    return int(sys.argv[1])

run_and_exit(main)
print("not reached" if sys.argv[1] == "raise" else "after main", flush=False)
"""


@pytest.mark.parametrize("how, status", [("0", 0), ("2", 2), ("exit", 3), ("raise", 1)])
def test_run_and_exit_keeps_status_output_and_atexit_handlers(tmp_path, how, status):
    script, marker = tmp_path / "script.py", tmp_path / "marker"
    script.write_text(EXITING)
    proc = subprocess.run(
        [sys.executable, str(script), how, str(marker)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.startswith("out\n") and proc.stderr.startswith("err\n")
    assert marker.read_text() == "ran"  # a handler registered after run_and_exit's still runs
    if how == "raise":
        assert "RuntimeError: boom" in proc.stderr and "not reached" not in proc.stdout
    elif how != "exit":
        assert proc.stdout.endswith("after main\n")
