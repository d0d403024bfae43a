"""The special token ids of an export: config.json's bos/eos/pad_token_id, generation_config.json.

transformers reads which token starts a text, which ends it and which pads from config.json,
and where `generate` stops from generation_config.json (without one, from config.json's
eos_token_id; with neither, it never stops before max_new_tokens). A conversion
(tools/convert_hf_to_dcp.py) keeps the source's config.json as hf_config.json and its
generation_config.json, and the export writes them back unchanged. A training checkpoint holds
the run's config.json (its checkpoint.init_from names the model the run started from), the
tokenizer files and, when init_from led to an HF config at the start of the run, a copy of it
(source_hf_config.json, source_generation_config.json). For a training checkpoint the ids are

- the source's own: from that copy, else where checkpoint.init_from leads now (followed through
  `dcp:` checkpoints that started from another; a relative path is taken from the current
  directory), for a model of the checkpoint's shape whose tokenizer.json (if any) is the
  checkpoint's;
- otherwise derived from the tokenizer saved with the checkpoint: bos is tokenizer_config.json's
  bos_token, else the end-of-text token (training data puts one before each document); eos is
  its eos_token, the chat template's end-of-turn token (`data.chat.end_of_turn_ids`), else the
  end-of-text token (`data.tokenizer.eos_id`); pad is its pad_token, if it names one.

Where both exist they are compared, and a disagreement is reported (the source's ids are kept).
generation_config.json (the source's, if it has one; else the ids above) stops at the config's
eos ids, the end-of-turn token and the end-of-text token: where tools/generate.py stops. The
instruction data ends prompt/completion samples with the end-of-text token and chat turns with
the end-of-turn token, so a fine-tuned model may end its answer with either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from hybrid2d.checkpoint import layout
from hybrid2d.checkpoint.hf import config_mismatch, model_config_from_hf, parse_init_from
from hybrid2d.checkpoint.hf_safetensors import CheckpointError, load_json
from hybrid2d.config import ModelConfig
from hybrid2d.data.chat import TOKENIZER_CONFIG, end_of_turn_ids
from hybrid2d.data.tokenizer import eos_id
from hybrid2d.errors import ConfigError

HF_CONFIG_COPY = "hf_config.json"  # the source's HF config.json, kept verbatim in a DCP dir
GENERATION_CONFIG = "generation_config.json"
SOURCE_CONFIG = "source_hf_config.json"  # a training checkpoint's copy of its source's config
SOURCE_GENERATION = "source_generation_config.json"  # ... and of its generation_config.json
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
MAX_HOPS = 16  # init_from chains followed at most this far (a loop ends there too)


@dataclass
class ExportTokens:
    config: dict  # TOKEN_KEYS -> id, list of ids or None, for config.json
    generation: dict  # generation_config.json
    source: str  # where `config` came from, for the summary
    notes: list[str] = field(default_factory=list)  # disagreements, a source not found

    def describe(self) -> str:
        ids = [f"{k.removesuffix('_token_id')} {self.config[k]}" for k in self.config]
        stops = self.generation.get("eos_token_id")
        line = f"{', '.join(ids) or 'none'} ({self.source}); generate stops at {stops}"
        return "; ".join([line, *self.notes])


@dataclass
class TokenizerIds:
    """The ids the tokenizer files of a directory imply."""

    config: dict  # TOKEN_KEYS -> id or None
    stops: list[int]  # end-of-turn ids, then the end-of-text id: tools/generate.py's stops


def _ids(value) -> list[int]:
    """An eos_token_id value (an id, a list of ids or None) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else [i for i in value if isinstance(i, int)]


def _one_or_list(ids: list[int]) -> int | list[int] | None:
    ids = list(dict.fromkeys(ids))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _named_token_id(config: dict, key: str, tok: Tokenizer) -> int | None:
    """The id of the token tokenizer_config.json names under key (a string, or an AddedToken
    object with its text under "content"), None if it names none the tokenizer knows."""
    value = config.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    return tok.token_to_id(text) if isinstance(text, str) and text else None


def tokenizer_ids(directory: Path) -> TokenizerIds | None:
    """The ids the tokenizer.json and tokenizer_config.json in directory imply (module doc);
    None without a readable tokenizer.json."""
    path = directory / layout.TOKENIZER
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # missing, or not a tokenizers file: the library raises plain Exception
        return None
    try:
        text_end = eos_id(tok)
    except ConfigError:  # none of the end-of-text tokens
        text_end = None
    turn_end = sorted(end_of_turn_ids(str(path), tok))
    config = load_json(directory / TOKENIZER_CONFIG, optional=True) or {}
    bos = _named_token_id(config, "bos_token", tok)
    ids = {
        "bos_token_id": bos if bos is not None else text_end,
        "eos_token_id": turn_end[0] if turn_end else text_end,
        "pad_token_id": _named_token_id(config, "pad_token", tok),
    }
    stops = [*turn_end, *([text_end] if text_end is not None else [])]
    return TokenizerIds(ids, list(dict.fromkeys(stops)))


@dataclass
class _Source:
    hf: dict  # its HF config.json
    generation: dict | None  # its generation_config.json
    where: str  # its config's path


def _tokenizer_text(path: Path) -> str | None:
    try:
        return Tokenizer.from_file(str(path)).to_str()
    except Exception:  # missing or unreadable: the tokenizers library raises plain Exception
        return None


def _checked(config: Path, generation: Path, cfg: ModelConfig, tokenizers) -> tuple:
    """(_Source, "") if the HF config.json at `config` is of cfg's shape and the tokenizers agree;
    else (None, why)."""
    where = str(config)
    hf = load_json(config, optional=True)
    if hf is None:
        return None, f"{where} not found"
    try:
        found = model_config_from_hf(hf, where)
    except CheckpointError as e:
        return None, str(e)
    if config_mismatch(found, cfg):
        return None, f"{where} is a model of another shape now"
    theirs, ours = tokenizers
    if theirs is not None and ours is not None and theirs != ours:
        return None, "the run trained with another tokenizer than the source's"
    return _Source(hf, load_json(generation, optional=True), where), ""


def resolve_source(init: str, cfg: ModelConfig, tokenizer: str | None) -> tuple:
    """(the HF config of the model checkpoint.init_from=init leads to, or None; why not).

    `dcp:` training checkpoints that started from another are followed (the copy they keep,
    else their own init_from); tokenizer (a tokenizers JSON string, or None) must equal the
    source's tokenizer.json where that exists."""
    for _ in range(MAX_HOPS):
        if not init:
            return None, ""  # trained from scratch (or from a checkpoint that was)
        try:
            kind, path = parse_init_from(init)
        except CheckpointError:
            return None, f"checkpoint.init_from={init!r} is no 'hf:' or 'dcp:' path"
        except ConfigError as e:  # a dcp: folder that holds no checkpoint (any more)
            return None, str(e)
        p = Path(path)
        config = p / ("config.json" if kind == "hf" else HF_CONFIG_COPY)
        generation = p / GENERATION_CONFIG
        if kind == "dcp" and not config.is_file():
            if load_json(p / SOURCE_CONFIG, optional=True) is not None:  # the copy it keeps
                config, generation = p / SOURCE_CONFIG, p / SOURCE_GENERATION
            elif (p / layout.CONFIG).is_file():  # a training checkpoint: follow its init_from
                run = load_json(p / layout.CONFIG, optional=True) or {}
                init = (run.get("checkpoint") or {}).get("init_from") or ""
                continue
        tokenizers = (_tokenizer_text(p / layout.TOKENIZER), tokenizer)
        source = _checked(config, generation, cfg, tokenizers)
        return source if source[0] else (None, f"{init}: {source[1]}")
    return None, f"checkpoint.init_from chain longer than {MAX_HOPS}"


def source_files(init: str, cfg: ModelConfig, tokenizer: str | None) -> dict[str, str]:
    """The source's HF config.json and generation_config.json, as files a training checkpoint
    keeps (SOURCE_CONFIG, SOURCE_GENERATION), so its export finds the source's token ids after
    the source has moved; {} when init_from leads to none."""
    source, _ = resolve_source(init, cfg, tokenizer)
    if source is None:
        return {}
    files = {SOURCE_CONFIG: json.dumps(source.hf, indent=2)}
    if source.generation is not None:
        files[SOURCE_GENERATION] = json.dumps(source.generation, indent=2)
    return files


def source_config(step: Path, cfg: ModelConfig) -> tuple[_Source | None, str]:
    """(the HF config of the model a training checkpoint started from, or None; why not): the
    copy the checkpoint keeps, else where its checkpoint.init_from leads now."""
    if load_json(step / SOURCE_CONFIG, optional=True) is not None:
        return _checked(step / SOURCE_CONFIG, step / SOURCE_GENERATION, cfg, (None, None))
    run = load_json(step / layout.CONFIG, optional=True) or {}
    init = (run.get("checkpoint") or {}).get("init_from") or ""
    return resolve_source(init, cfg, _tokenizer_text(step / layout.TOKENIZER))


def _disagreements(source: dict, derived: dict, tokenizer: str) -> list[str]:
    """Where the tokenizer's ids differ from the source config's (both known)."""
    notes = []
    for key in TOKEN_KEYS:
        theirs, ours = source.get(key), derived.get(key)
        if theirs is None or ours is None:
            continue
        if ours not in _ids(theirs):
            notes.append(
                f"{tokenizer} implies {key} {ours}, the source's config has {theirs} (kept)"
            )
    return notes


def export_tokens(step: str | Path, cfg: ModelConfig) -> ExportTokens:
    """config.json's token ids and generation_config.json for an export of a training checkpoint
    (a DCP directory without hf_config.json); see the module doc."""
    step = Path(step)
    derived = tokenizer_ids(step)
    source, missing = source_config(step, cfg)
    notes = [f"source's ids not used: {missing}"] if missing else []
    if source is not None:
        ids = {k: source.hf[k] for k in TOKEN_KEYS if k in source.hf}
        where = f"from {source.where}"
        if derived is not None:
            notes += _disagreements(source.hf, derived.config, "the checkpoint's tokenizer")
        generation = dict(source.generation or ids)
    elif derived is not None:
        ids = dict(derived.config)
        where = f"from the checkpoint's {layout.TOKENIZER} / {TOKENIZER_CONFIG}"
        generation = dict(ids)
    else:
        ids = dict.fromkeys(TOKEN_KEYS)  # null: transformers must not invent Llama's 1 and 2
        where = f"no {layout.TOKENIZER} in the checkpoint"
        generation = dict(ids)
    own = load_json(step / GENERATION_CONFIG, optional=True)  # none in today's training checkpoints
    if own is not None:
        generation = own
    stops = _ids(generation.get("eos_token_id", ids.get("eos_token_id")))
    stops += derived.stops if derived is not None else []
    if _one_or_list(stops) != generation.get("eos_token_id"):
        generation["eos_token_id"] = _one_or_list(stops)
        generation.pop("_from_model_config", None)  # no longer what config.json implies
    return ExportTokens(ids, generation, where, notes)


def tokenizer_config(step: Path, tokens: ExportTokens, cfg: ModelConfig) -> dict | None:
    """tokenizer_config.json for the export of a checkpoint whose tokenizer came without one
    (the project's own BPE): the fast-tokenizer class (no token added to what tokenizer.json
    encodes), the bos/eos/pad tokens of `tokens` by name, the model's length; None where the
    checkpoint has one (it is copied) or has no tokenizer.json."""
    if (step / TOKENIZER_CONFIG).is_file():
        return None
    try:
        tok = Tokenizer.from_file(str(step / layout.TOKENIZER))
    except Exception:  # none, or unreadable: the tokenizers library raises plain Exception
        return None
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in TOKEN_KEYS:
        ids = _ids(tokens.config.get(key))
        name = tok.id_to_token(ids[0]) if ids else None
        if name is not None:
            config[key.removesuffix("_id")] = name
    config["model_max_length"] = cfg.max_position_embeddings
    return config
