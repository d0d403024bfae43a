"""HF safetensors <-> DCP conversion and init_from, one process; HF transformers is the reference.

The 2x2-mesh versions are in test_hf_mesh.py.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hybrid2d.checkpoint.hf import (  # noqa: E402
    CheckpointError,
    expected_shapes,
    hf_config_from_model,
    load_pretrained,
    model_config_from_hf,
)
from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf, convert_hf_to_dcp  # noqa: E402
from hybrid2d.checkpoint.hf_safetensors import SafetensorsFile  # noqa: E402
from hybrid2d.config import ModelConfig  # noqa: E402
from hybrid2d.models.llama import Llama  # noqa: E402
from tests.launch import REPO  # noqa: E402
from tests.workers.hf_models import CASES, make_hf_model  # noqa: E402

TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (directory, the transformers model it holds)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), make_hf_model(name, str(root / name))) for name in CASES}


@pytest.fixture(scope="module")
def dcp_dirs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for name, (path, _) in hf_dirs.items():
        out[name] = str(root / name)
        convert_hf_to_dcp(path, out[name], progress=False)
    return out


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(path: str, spec: str) -> torch.Tensor:
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    cfg = model_config_from_hf(data) if "architectures" in data else None
    if cfg is None:  # a DCP dir: hybrid2d config.json
        cfg = ModelConfig(**{k: v for k, v in data["model"].items()})
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_pretrained(model, spec)
    with torch.no_grad():
        return model.eval()(TOKENS)


def hf_tensors(path: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


# ---- config ----------------------------------------------------------------------------------


def test_both_rope_conventions_give_the_same_config(hf_dirs):
    path, _ = hf_dirs["gqa-llama3"]
    with open(os.path.join(path, "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5
    legacy = dict(v5)
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest spelling
    legacy["rope_scaling"] = rope
    a, b = model_config_from_hf(v5), model_config_from_hf(legacy)
    assert a == b
    assert (a.rope_theta, a.rope_scaling_factor, a.rope_original_max_position) == (5e5, 8.0, 16)
    assert (a.n_kv_heads, a.vocab_size, a.max_position_embeddings) == (2, 130, 256)


def test_model_config_round_trips_through_transformers(tmp_path):
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=130,
        rope_theta=5e5, rope_scaling_factor=8.0, rope_original_max_position=16,
        tie_embeddings=True, max_position_embeddings=512, norm_eps=1e-6,
    )  # fmt: skip
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config_from_model(cfg), f)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert theirs.rope_parameters["rope_type"] == "llama3"
    assert theirs.rope_parameters["rope_theta"] == 5e5
    assert theirs.tie_word_embeddings and theirs.max_position_embeddings == 512
    back = model_config_from_hf(theirs.to_dict())
    assert back == cfg


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture MixtralForCausalLM; "
         "supported: LlamaForCausalLM, MistralForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for LlamaForCausalLM"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
         "rope type 'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_rejected(hf_dirs, change, message):
    with open(os.path.join(hf_dirs["gqa-llama3"][0], "config.json")) as f:
        data = json.load(f)
    data.update(change)
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(data)


# ---- reading ---------------------------------------------------------------------------------


def test_slices_equal_safe_open_get_slice(tmp_path):
    tensors = {
        "a": torch.randn(7, 9),
        "b": torch.randn(3, 4, 5).bfloat16(),
        "c": torch.randn(11),
        "d": torch.randn(0, 4),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    gen = torch.Generator().manual_seed(0)
    with SafetensorsFile(str(tmp_path / "x.safetensors")) as ours:
        with safe_open(tmp_path / "x.safetensors", "pt") as ref:
            for name, t in tensors.items():
                assert torch.equal(ours.read(name), t)
                for _ in range(30):
                    offs = [int(torch.randint(0, s + 1, (), generator=gen)) for s in t.shape]
                    sizes = [
                        int(torch.randint(0, s - o + 1, (), generator=gen))
                        for s, o in zip(t.shape, offs, strict=True)
                    ]
                    index = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
                    before = ours.bytes_read
                    got = ours.read_slice(name, offs, sizes)
                    assert torch.equal(got, ref.get_slice(name)[index]), (name, offs, sizes)
                    # Only the block's bytes are read.
                    assert ours.bytes_read - before == got.numel() * got.element_size()


# ---- HF -> DCP -> hybrid2d, HF -> hybrid2d ---------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_dcp_logits_equal_transformers(hf_dirs, dcp_dirs, case):
    expected = hf_logits(hf_dirs[case][1])
    got = our_logits(dcp_dirs[case], f"dcp:{dcp_dirs[case]}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_init_from_hf_logits_equal_transformers(hf_dirs, case):
    path, model = hf_dirs[case]
    got = our_logits(path, f"hf:{path}")
    torch.testing.assert_close(got, hf_logits(model), rtol=1e-5, atol=1e-5)


def test_dcp_dir_is_self_describing(hf_dirs, dcp_dirs):
    src, dst = hf_dirs["tied"][0], dcp_dirs["tied"]
    names = set(os.listdir(dst))
    assert {".metadata", "config.json", "hf_config.json", "tokenizer.json"} <= names
    with open(os.path.join(dst, "config.json")) as f:
        job = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        assert ModelConfig(**job["model"]) == model_config_from_hf(json.load(f))
    assert {"train", "parallel", "checkpoint"} <= set(job)


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_layout_is_that_of_training_checkpoints(dcp_dirs, case):
    """{"model": {name: tensor}} with the names get_model_state_dict gives (which keeps
    lm_head.weight for a tied model), so dcp.py's readers accept converted directories."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with open(os.path.join(dcp_dirs[case], "config.json")) as f:
        model = Llama(ModelConfig(**json.load(f)["model"]))
    meta = FileSystemReader(dcp_dirs[case]).read_metadata().state_dict_metadata
    expected = {f"model.{k}": tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    assert {k: tuple(v.size) for k, v in meta.items()} == expected


def test_training_checkpoint_loads_model_entry_only(hf_dirs, tmp_path):
    """A training step dir has "optimizer" and "trainer" entries too, non-tensor ones among
    them (stored as bytes, with no offset); dcp: reads "model"."""
    import torch.distributed.checkpoint as dcp

    path, model = hf_dirs["gqa-llama3"]
    sd = model.state_dict()
    state = {
        "model": sd,
        "optimizer": {"state": {"x": torch.ones(3)}, "param_groups": [{"lr": 3e-4}]},
        "trainer": {"step": torch.tensor(7)},
    }
    step_dir = str(tmp_path / "step-00000007")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=step_dir, no_dist=True)
    torch.testing.assert_close(
        our_logits(path, f"dcp:{step_dir}"), hf_logits(model), rtol=1e-5, atol=1e-5
    )


# ---- DCP -> HF ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_to_hf_loads_in_transformers(hf_dirs, dcp_dirs, tmp_path, case):
    out = str(tmp_path / "hf")
    summary = convert_dcp_to_hf(dcp_dirs[case], out, max_shard_bytes=60_000, progress=False)
    assert summary.files > 1
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == {
        os.path.basename(p) for p in glob.glob(os.path.join(out, "*.safetensors"))
    }
    for p in glob.glob(os.path.join(out, "*.safetensors")):  # size cap (single big tensors aside)
        assert os.path.getsize(p) < 60_000 + 100_000
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(theirs), hf_logits(hf_dirs[case][1]), rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_dcp_to_hf_is_bit_identical(hf_dirs, dcp_dirs, tmp_path, case):
    out = str(tmp_path / "hf")
    convert_dcp_to_hf(dcp_dirs[case], out, progress=False)
    a, b = hf_tensors(hf_dirs[case][0]), hf_tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_bf16_round_trip_and_dtype_option(tmp_path):
    src = str(tmp_path / "bf16")
    make_hf_model("gqa-llama3", src, dtype=torch.bfloat16)
    convert_hf_to_dcp(src, str(tmp_path / "dcp"), progress=False)
    convert_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"), progress=False)
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "back"))
    assert all(a[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]) for n in a)
    # --dtype: fp32 on disk -> fp16 in DCP -> fp32 export
    convert_hf_to_dcp(src, str(tmp_path / "dcp16"), dtype=torch.float16, progress=False)
    convert_dcp_to_hf(
        str(tmp_path / "dcp16"), str(tmp_path / "back32"), dtype=torch.float32, progress=False
    )
    c = hf_tensors(str(tmp_path / "back32"))
    assert all(c[n].dtype == torch.float32 and torch.equal(c[n], a[n].half().float()) for n in a)
    with open(tmp_path / "back32" / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    # No --dtype on the way back: the config names the dtype written (fp16), not the source's
    # (bf16), so transformers loads the tensors as they are instead of casting them.
    convert_dcp_to_hf(str(tmp_path / "dcp16"), str(tmp_path / "back16"), progress=False)
    assert all(t.dtype == torch.float16 for t in hf_tensors(str(tmp_path / "back16")).values())
    with open(tmp_path / "back16" / "config.json") as f:
        assert json.load(f)["dtype"] == "float16"


# ---- streaming: peak memory ------------------------------------------------------------------


def test_converters_stream_tensor_by_tensor(tmp_path):
    """A ~85 MB model whose largest tensor is 8 MB converts with a peak far below its size."""
    cfg = ModelConfig(dim=256, n_layers=16, n_heads=8, n_kv_heads=8, ffn_dim=1024, vocab_size=8192)
    src = tmp_path / "big"
    src.mkdir()
    with open(src / "config.json", "w") as f:
        json.dump(hf_config_from_model(cfg), f)
    gen = torch.Generator().manual_seed(0)
    shard, n, weight_map = {}, 0, {}
    for name, shape in expected_shapes(cfg).items():
        shard[name] = torch.randn(shape, generator=gen)
        if sum(t.numel() for t in shard.values()) > 4_000_000:
            n += 1
            save_file(shard, src / f"model-{n}.safetensors", metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, f"model-{n}.safetensors"))
            shard = {}
    n += 1
    save_file(shard, src / f"model-{n}.safetensors", metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, f"model-{n}.safetensors"))
    del shard
    with open(src / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    to_dcp = convert_hf_to_dcp(str(src), str(tmp_path / "dcp"), progress=False)
    back = convert_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), progress=False)
    model_bytes = cfg.num_params() * 4
    assert to_dcp.bytes == back.bytes == model_bytes > 80 * 2**20
    assert to_dcp.largest_tensor == 8 * 2**20
    print(to_dcp.lines("hf -> dcp"), back.lines("dcp -> hf"), sep="\n")
    # Whole-model buffering would show ~85 MB; streaming shows a few tensors' worth.
    assert to_dcp.peak_memory_growth < model_bytes / 3, to_dcp.lines("hf -> dcp")
    assert back.peak_memory_growth < model_bytes / 3, back.lines("dcp -> hf")


# ---- bad input -------------------------------------------------------------------------------


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / f"{tool}.py"), *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def tool_error(capsys, tool: str, *args: str) -> str:
    """Run a tool's main() in process: it must return non-zero with exactly one stderr line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(tool, REPO / "tools" / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main([*args, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def broken(hf_dirs, tmp_path):
    def copy(case="gqa-llama3"):
        dst = tmp_path / "src"
        shutil.copytree(hf_dirs[case][0], dst)
        return dst

    return copy


def test_missing_shard(broken, tmp_path, capsys):
    src = broken()
    with open(src / "model.safetensors.index.json") as f:
        victim = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(src / victim)
    err = tool_error(capsys, "convert_hf_to_dcp", str(src), str(tmp_path / "out"))
    assert f"names shard {victim}" in err and "missing" in err
    assert not os.path.exists(tmp_path / "out")


def test_shape_mismatch(broken, tmp_path, capsys):
    src = broken()
    with open(src / "config.json") as f:
        data = json.load(f)
    data["intermediate_size"] = 100
    with open(src / "config.json", "w") as f:
        json.dump(data, f)
    err = tool_error(capsys, "convert_hf_to_dcp", str(src), str(tmp_path / "out"))
    assert "model.layers.0.mlp.gate_proj.weight has shape [96, 64]" in err
    assert "implies [100, 64]" in err


def test_unsupported_architecture(broken, tmp_path, capsys):
    src = broken()
    with open(src / "config.json") as f:
        data = json.load(f)
    data["architectures"] = ["GPT2LMHeadModel"]
    with open(src / "config.json", "w") as f:
        json.dump(data, f)
    err = tool_error(capsys, "convert_hf_to_dcp", str(src), str(tmp_path / "out"))
    assert "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM" in err


def test_empty_directories(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = tool_error(capsys, "convert_hf_to_dcp", str(tmp_path / "empty"), str(tmp_path / "o1"))
    assert "is empty" in err
    err = tool_error(capsys, "convert_dcp_to_hf", str(tmp_path / "empty"), str(tmp_path / "o2"))
    assert "no .metadata" in err


def test_tool_exit_status_and_summary(hf_dirs, tmp_path):
    """The tools as users run them: non-zero exit on bad input, a summary on success."""
    bad = run_tool("convert_hf_to_dcp", str(tmp_path / "nope"), str(tmp_path / "o"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: ")
    assert len(bad.stderr.strip().splitlines()) == 1
    ok = run_tool("convert_hf_to_dcp", hf_dirs["tied"][0], str(tmp_path / "dcp"), "--dtype", "bf16")
    assert ok.returncode == 0, ok.stderr
    for word in ("tensors", "bytes", "time", "peak memory"):
        assert word in ok.stdout


def test_init_from_config_mismatch_names_the_key(hf_dirs, dcp_dirs):
    path, _ = hf_dirs["gqa-llama3"]
    with open(os.path.join(path, "config.json")) as f:
        cfg = model_config_from_hf(json.load(f))
    cfg.n_kv_heads = 4
    with torch.device("meta"):
        model = Llama(cfg)
    for spec in (f"hf:{path}", f"dcp:{dcp_dirs['gqa-llama3']}"):
        with pytest.raises(CheckpointError) as info:
            load_pretrained(model, spec)
        assert "num_key_value_heads=2 but model.n_kv_heads=4" in str(info.value)
        assert "\n" not in str(info.value)


def test_init_from_shape_mismatch_names_tensor_and_shapes(dcp_dirs, tmp_path):
    """A DCP dir without config.json is checked tensor by tensor."""
    src = tmp_path / "dcp"
    shutil.copytree(dcp_dirs["gqa-llama3"], src)
    os.remove(src / "config.json")
    cfg = model_config_from_hf(json.load(open(src / "hf_config.json")))
    cfg.ffn_dim = 128
    with torch.device("meta"):
        model = Llama(cfg)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \[96, 64\] but the "
                       r"model implies \[128, 64\]"):  # fmt: skip
        load_pretrained(model, f"dcp:{src}")
    with pytest.raises(CheckpointError, match="is not 'hf:PATH'"):
        load_pretrained(model, f"s3:{src}")
