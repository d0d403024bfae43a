"""`--checkpoint.init_from hf:DIR` takes the model shape from DIR's config.json."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO, launcher_env

transformers = pytest.importorskip("transformers")
from tests.workers.hf_chat import make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="100KB")
    make_tokenizer(str(path))  # init_from needs the checkpoint's tokenizer (or data.tokenizer)
    return path


def train(tmp_path, *args):
    env = launcher_env()
    cmd = [
        sys.executable,
        "recipes/llama.py",
        "--train.seq_len",
        "32",
        "--data.max_chars",
        "100000",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--metrics.progress_bar",
        "false",
        "--metrics.run_dir",
        str(tmp_path / "run"),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_model_shape_comes_from_the_checkpoint(hf_dir, tmp_path):
    proc = train(tmp_path, "--checkpoint.init_from", f"hf:{hf_dir}", "--train.steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (
        model["dim"],
        model["n_layers"],
        model["n_heads"],
        model["n_kv_heads"],
        model["ffn_dim"],
        model["vocab_size"],
    ) == (64, 2, 4, 2, 96, 512)


def test_conflicting_model_setting_is_one_line_before_training(hf_dir, tmp_path):
    proc = train(tmp_path, "--checkpoint.init_from", f"hf:{hf_dir}", "--model.dim", "128")
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "dim" in errors[0], proc.stderr
    assert not (tmp_path / "run").exists()  # failed before the run directory was made


@pytest.mark.parametrize(
    "given", [("n_kv_heads", "2"), ("n_kv_heads", "4")], ids=["agrees", "differs"]
)
def test_only_the_model_settings_given_are_checked(hf_dir, tmp_path, given):
    """--model.n_kv_heads with init_from: the other fields are the checkpoint's, not the
    recipe's, so an agreeing value trains and a differing one is named (the error once named
    model.dim, a setting the user never gave)."""
    name, value = given
    proc = train(tmp_path, "--checkpoint.init_from", f"hf:{hf_dir}", f"--model.{name}", value,
                 "--train.steps", "1")  # fmt: skip
    if value == "2":
        assert proc.returncode == 0, proc.stderr[-3000:]
        model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
        assert (model["dim"], model["n_kv_heads"], model["vocab_size"]) == (64, 2, 512)
    else:
        assert proc.returncode == 2
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert "num_key_value_heads=2 but model.n_kv_heads=4" in line, line
