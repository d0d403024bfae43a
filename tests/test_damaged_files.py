"""Every damaged file is named, with what to do, in one line: a data cache file, a DCP
.metadata (before the model's settings are compared with the checkpoint), a safetensors header.
(A damaged data.tokenizer and chat template: tests/test_data_errors.py, test_finetune_data.py.)"""

import dataclasses
import json
import warnings

import pytest
import torch.distributed.checkpoint as dcp

from hybrid2d.checkpoint import layout
from hybrid2d.checkpoint.hf import source_model
from hybrid2d.checkpoint.hf_safetensors import SafetensorsFile
from hybrid2d.config import DataConfig
from hybrid2d.data.chat import load_chat_template
from hybrid2d.data.tokenizer import load_or_train_tokenizer
from hybrid2d.data.tokens import tokenize_corpus
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import Llama
from tests.reference import tiny_config


@pytest.fixture
def corpus(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of a small corpus, {i * 7 % 13}\n" for i in range(200)))
    return DataConfig(path=str(text)), tmp_path / "cache"


def _one_file(folder):
    (found,) = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return found


def _damaged(error: ConfigError, path) -> None:
    message = str(error)
    assert message.startswith(f"data cache file {path} is damaged ("), message
    assert message.endswith("; delete it and launch again, it is rebuilt from the data")
    assert "\n" not in message


@pytest.mark.parametrize("damage", ["truncate", "junk"])
def test_a_damaged_token_cache_file_is_named(corpus, damage):
    cfg, cache = corpus
    tok = load_or_train_tokenizer(cfg, 300, cache)
    first = tokenize_corpus(cfg, tok, cache).tolist()  # a copy: the file is overwritten below
    npy = _one_file(cache / "tokens")
    data = npy.read_bytes()
    npy.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not an array" * 9)
    with pytest.raises(ConfigError) as e:
        tokenize_corpus(cfg, tok, cache)
    _damaged(e.value, npy)
    npy.unlink()  # what the message says to do
    assert tokenize_corpus(cfg, tok, cache).tolist() == first


def test_a_damaged_cached_tokenizer_is_named(corpus):
    cfg, cache = corpus
    load_or_train_tokenizer(cfg, 300, cache)
    saved = _one_file(cache / "tokenizers")
    saved.write_text(saved.read_text()[:500])  # cut mid-JSON
    with pytest.raises(ConfigError) as e:
        load_or_train_tokenizer(cfg, 300, cache)
    _damaged(e.value, saved)


def test_a_damaged_dcp_metadata_is_named_before_the_model_settings_are_blamed(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": Llama(cfg.model).state_dict()}, checkpoint_id=str(path), no_dist=True)
    (path / layout.CONFIG).write_text(json.dumps(cfg.to_dict()))
    (path / layout.METADATA).write_bytes(b"\x80\x04junk")
    run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dim=cfg.model.dim * 2))
    run.checkpoint.init_from = f"dcp:{path}"
    with pytest.raises(ConfigError) as e:  # it blamed --model.dim, which does not match
        source_model(run, {"model.dim"})
    message = str(e.value)
    assert f"checkpoint {path}: .metadata cannot be read" in message, message
    assert "model.dim" not in message and "truncated or corrupted" in message


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "data_offsets": [0, 16]},  # no shape
        {"dtype": "F32", "shape": [4], "data_offsets": [0]},
        {"dtype": "F32", "shape": ["four"], "data_offsets": [0, 16]},
    ],
)
def test_a_safetensors_header_that_lies_is_named(tmp_path, entry):
    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ConfigError) as e:
        SafetensorsFile(str(path))
    assert str(e.value) == (
        f"{path}: tensor w's header entry has no valid shape and data_offsets (a damaged "
        "safetensors file); download or export it again"
    )
    path.write_bytes(len(b"[1]").to_bytes(8, "little") + b"[1]")
    with pytest.raises(ConfigError, match="malformed safetensors header"):
        SafetensorsFile(str(path))


def test_a_damaged_tokenizer_json_is_named(corpus, tmp_path):
    cfg, cache = corpus
    load_or_train_tokenizer(cfg, 300, cache)
    broken = tmp_path / "tok" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text(_one_file(cache / "tokenizers").read_text()[:300])
    with pytest.raises(ConfigError) as e:
        load_or_train_tokenizer(DataConfig(tokenizer=str(broken.parent)), 300, cache)
    message = str(e.value)
    assert message.startswith(f"data.tokenizer={str(broken.parent)!r}: {broken} is not a ")
    assert message.endswith("use a tokenizer.json saved by the tokenizers library")


@pytest.mark.parametrize(
    "name, text, said",
    [
        ("tokenizer_config.json", '{"chat_template": "{{', "is not JSON"),
        ("tokenizer_config.json", "[1, 2]", "is not a JSON object"),
        ("chat_template.jinja", "{% for m in messages %}{{ m.content }}", "does not compile"),
        ("chat_template.jinja", b"\xff\xfe{{ x }}", "is not UTF-8 text"),
    ],
)
def test_a_damaged_chat_template_is_named(tmp_path, name, text, said):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # not read here
    damaged = folder / name
    damaged.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        load_chat_template(str(folder))
    message = str(e.value)
    assert str(damaged) in message and said in message and "\n" not in message, message
