"""Everything a training process needs from the data package, built once per job.

Only the main process trains the tokenizer and tokenizes the corpus; the others wait at the
barrier and then read its cached files. That keeps the expensive work to one process (the default
run puts 4 processes on 2 cores) and guarantees every rank uses byte-identical data.

Text data is packed into windows (packing.py), with data.document_mask on each window's
documents masked apart; instruction data (instruct.py: .jsonl of prompt/completion or messages)
is one sample per line with the loss on the completion, packed into rows (rows.py) or one padded
row each (data.packing). Validation data (data.val_path, or a data.val_fraction of data.path's
samples held out) must be of the training data's kind, is built and laid out the same way and
served by `EvalSet`, identically on every mesh. The data figures (RunData.stats, summary.json's
`data`) describe the training samples only, and the held-out ones under `val`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.config import JobConfig
from hybrid2d.data.cache import atomic_path, cache_key, must_build, read_cached, save_npy
from hybrid2d.data.chat import SCRATCH_TEMPLATE, ChatTemplate, load_chat_template
from hybrid2d.data.corpus import corpus_identity, is_hf_dataset, source_files
from hybrid2d.data.instruct import (
    InstructionDataset,
    InstructStats,
    build_instruction_arrays,
    is_instruction_file,
    sample_texts,
)
from hybrid2d.data.loader import GlobalBatchLoader, PackingCounts
from hybrid2d.data.mixture import MixtureLoader, parse_mixture, source_seed
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.run_data import PREVIEW_STEPS, EvalSet, PackedRows, RunData, Subset
from hybrid2d.data.shards import TOKENIZER, TOOL, is_preprocessed, open_shards
from hybrid2d.data.stream import StreamingLoader, WindowStream
from hybrid2d.data.tokenizer import (
    eos_id,
    load_or_train_tokenizer,
    tokenizer_hash,
    trained_tokenizer_dir,
)
from hybrid2d.data.tokens import tokenize_corpus
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.paths import HF_PREFIX

DEFAULT_CACHE_DIR = "~/.cache/hybrid2d"
VAL_SPLIT_SEED = 1234  # the held-out part of data.path does not move with train.seed


def cache_dir_for(cfg: JobConfig) -> pathlib.Path:
    return pathlib.Path(cfg.data.cache_dir or DEFAULT_CACHE_DIR).expanduser()


def data_kind(cfg: JobConfig, files: list[pathlib.Path], setting: str = "data.path") -> str:
    fmt = cfg.data.format
    if fmt == "text":
        return "text"
    jsonl = bool(files) and all(p.suffix == ".jsonl" for p in files)
    if fmt == "instruct":
        if not jsonl:
            raise ConfigError(
                f"data.format=instruct needs .jsonl files, but {setting} holds "
                f"{sorted({p.suffix for p in files})}; use .jsonl or data.format text"
            )
        return "instruct"
    return "instruct" if jsonl and is_instruction_file(files[0]) else "text"


def _instruct_cache(
    cfg: JobConfig, d, tok: Tokenizer, template, cache_dir: pathlib.Path, setting: str,
    build: bool,
) -> InstructionDataset:  # fmt: skip
    key = cache_key(
        "instruct-v3",  # v3: prompt/completion samples start with the tokenizer's BOS
        corpus_identity(d),
        tokenizer_hash(tok),
        template.source if template is not None else "",
        json.dumps(template.special if template is not None else {}, sort_keys=True),
        cfg.train.seq_len,
    )
    folder = cache_dir / "instruct" / key
    meta_path = folder / "meta.json"  # written last: its presence means the entry is complete
    names = ("tokens", "targets", "offsets", "sample_loss_tokens", "sample_truncated")
    if must_build(meta_path, build, cache_dir, f"instruction cache {key}"):
        files = source_files(d, setting)
        ds = build_instruction_arrays(files, tok, template, cfg.train.seq_len, setting)
        arrays = (
            ds.tokens,
            ds.targets_flat,
            ds.offsets,
            ds.sample_loss_tokens,
            ds.sample_truncated,
        )
        for name, array in zip(names, arrays, strict=True):
            save_npy(folder / f"{name}.npy", array)
        meta = {"pad_id": ds.pad_id, "seq_len": ds.seq_len, "stats": dataclasses.asdict(ds.stats)}
        with atomic_path(meta_path) as tmp:
            tmp.write_text(json.dumps(meta))
    meta = read_cached(meta_path, lambda p: json.loads(p.read_text()))
    arrays = [read_cached(folder / f"{n}.npy", lambda p: np.load(p, mmap_mode="r")) for n in names]
    stats = InstructStats(**meta["stats"])
    return InstructionDataset(*arrays[:3], meta["seq_len"], meta["pad_id"], stats, *arrays[3:])


def _dataset(
    cfg: JobConfig, d, tok: Tokenizer, tok_dir: str, cache_dir, setting: str, build: bool
):  # fmt: skip
    """(dataset, kind) for the data config d (data.path's, or val_path's in its place), with
    the chat template stored in tok_dir."""
    if is_preprocessed(d.path):  # shards of tools/tokenize_corpus.py: nothing to tokenize
        # Every caller checked each shard's file on this rank already (`_kind`): one stat each.
        tokens = open_shards(d.path, setting, check_files=False)
        tokens.check_tokenizer(tok, d.tokenizer, setting)
        kind = "text"
    else:
        kind = _kind(cfg, d, setting)
        if kind == "instruct":
            template = load_chat_template(tok_dir)
            return _instruct_cache(cfg, d, tok, template, cache_dir, setting, build), kind
        tokens = tokenize_corpus(d, tok, cache_dir, build=build, setting=setting)
    eos = eos_id(tok) if cfg.data.document_mask == "on" else None
    return PackedDataset(tokens, cfg.train.seq_len, source=d.path, eos=eos), kind


def _kind(cfg: JobConfig, d, setting: str) -> str:
    """The kind of d's data; a preprocessed corpus is text, checked here (its index and the size
    of every shard, by the file system alone) so that a damaged one fails on every rank. Data
    read through the datasets package (an hf: path, a save_to_disk directory) is text."""
    if is_hf_dataset(d.path):
        source_files(d, setting)  # its spelling, its directory, the datasets package
        if cfg.data.format == "instruct":
            raise ConfigError(
                f"data.format=instruct, but {setting}={d.path!r} is read through the datasets "
                "package, as text (column data.text_field); use data.format auto or text, or "
                "give instruction data as .jsonl"
            )
        return "text"
    if not is_preprocessed(d.path):
        return data_kind(cfg, source_files(d, setting), setting)
    if cfg.data.format == "instruct":
        raise ConfigError(
            f"data.format=instruct, but {setting}={d.path!r} is a preprocessed text corpus "
            f"({TOOL}); use data.format auto or text"
        )
    if not d.tokenizer:
        raise ConfigError(
            f"data.tokenizer is '' (a BPE trained on the corpus), but {setting}={d.path!r} is "
            f"tokenized already; set data.tokenizer to "
            f"{pathlib.Path(d.path).expanduser() / TOKENIZER}, the tokenizer it was made with"
        )
    open_shards(d.path, setting)
    return "text"


def check_kinds(cfg: JobConfig, d, val_cfg) -> str:
    """The training data's kind, after checking that the validation data has the same one and
    that the layout settings fit it (file names and first lines only: cheap, on every rank)."""
    kind = _kind(cfg, d, "data.path")
    if val_cfg is not None:
        val_kind = _kind(cfg, val_cfg, "data.val_path")
        # An empty file is said when it is read.
        if val_kind != kind and (
            is_preprocessed(val_cfg.path)
            or is_hf_dataset(val_cfg.path)
            or any(map(_has_text, source_files(val_cfg, "data.val_path")))
        ):
            raise ConfigError(
                f"data.val_path={d.val_path!r} is {_KIND_NAME[val_kind]} but data.path="
                f"{d.path!r} is {_KIND_NAME[kind]}: validation is measured on the training "
                "data's kind; give a held-out file of the same format (or use data.val_fraction)"
            )
    if kind == "text" and cfg.data.packing == "padded":
        raise ConfigError(
            f"data.packing=padded is for instruction data, but data.path={d.path!r} is text "
            "(its windows hold no padding); leave data.packing at packed, or use "
            "data.document_mask on to keep attention within documents"
        )
    if kind == "instruct" and cfg.data.document_mask == "on":
        raise ConfigError(
            f"data.document_mask=on is for text data, but data.path={d.path!r} is instruction "
            "data, whose samples are always apart (packed rows mask them apart, padded rows "
            "hold one each); leave data.document_mask at off"
        )
    return kind


def _has_text(path: pathlib.Path) -> bool:
    """True if the file holds a line that is not blank (read up to the first such line)."""
    with open(path, "rb") as f:
        return any(line.strip() for line in f)


_KIND_NAME = {"text": "text data", "instruct": "instruction data (prompt/completion or messages)"}


def _val_config(data):
    """data.val_path as a DataConfig (its path in data.path's place) whose files exist, or None."""
    if not data.val_path:
        return None
    d = dataclasses.replace(data, path=data.val_path, val_path="", val_fraction=0.0)
    if not is_preprocessed(d.path):
        source_files(d, "data.val_path")
    return d


def _text_val_config(cfg: JobConfig, d, training: str):
    """data.val_path as a DataConfig beside text training data (`training` names the setting
    that gave it), or None: held-out instruction data is one line, since validation is measured
    on the training data's kind."""
    val_cfg = _val_config(d)
    if val_cfg is not None and _kind(cfg, val_cfg, "data.val_path") != "text":
        raise ConfigError(
            f"data.val_path={d.val_path!r} is {_KIND_NAME['instruct']}, but {training} is text: "
            "validation is measured on the training data's kind; give held-out text"
        )
    return val_cfg


def _held_out_text(
    cfg: JobConfig, val_cfg, tok, tok_dir, cache_dir, stats: dict, is_main=False, barrier=None
):  # fmt: skip
    """The EvalSet of text data.val_path, its sample count in stats; None without one. With a
    barrier the main process tokenizes it first (paths that tokenized nothing else before
    theirs); without, it was tokenized already."""
    if val_cfg is None:
        return None
    if barrier is not None:
        if is_main:
            _dataset(cfg, val_cfg, tok, tok_dir, cache_dir, "data.val_path", build=True)
        barrier()
    val_ds, _ = _dataset(cfg, val_cfg, tok, tok_dir, cache_dir, "data.val_path", build=False)
    stats["val_samples"] = len(val_ds)
    return EvalSet(val_ds, repr(val_cfg.path))


def build_run_data(
    cfg: JobConfig, layout: RunLayout, dp_rank: int, is_main: bool, barrier: Callable[[], None],
    all_gather: Callable[[object], list] | None = None, readers: tuple[int, int] | None = None,
) -> RunData:  # fmt: skip
    """Loader for this dp rank, tokenizer, validation set; the tokenizer, the vocabulary size
    and the batch split are the layout's. Every process must call it (it calls barrier()).
    Streaming: this rank is reader readers[0] of readers[1] (default: its dp rank of dp) and
    all_gather gathers over the readers."""
    d, t = dataclasses.replace(cfg.data, tokenizer=layout.tokenizer), cfg.train
    vocab_size = layout.model.vocab_size
    cache_dir = cache_dir_for(cfg)
    if d.streaming:
        readers = readers or (dp_rank, layout.dp)
        if d.mixture:
            return _streamed_mixture_run_data(
                cfg, d, layout, dp_rank, all_gather, is_main, barrier, readers
            )
        return _streaming_run_data(cfg, d, layout, dp_rank, all_gather, is_main, barrier, readers)
    if d.mixture:
        return _mixture_run_data(cfg, d, layout, dp_rank, is_main, barrier)
    # Cheap checks on every rank first, so a bad data.path fails everywhere at once instead of
    # leaving the other ranks waiting at the barrier for a main process that already died.
    val_cfg = _val_config(d)
    kind = check_kinds(cfg, d, val_cfg)
    if d.tokenizer:
        load_or_train_tokenizer(d, vocab_size, cache_dir, build=False)
    tok_dir, samples = d.tokenizer, None
    if kind == "instruct" and not d.tokenizer:
        # A tokenizer of the samples as the model reads them, with the chat template's turn
        # markers as tokens (tokenizer.py); its directory holds the template too.
        tok_dir = str(trained_tokenizer_dir(d, vocab_size, cache_dir, instruct=True))
        template = ChatTemplate(SCRATCH_TEMPLATE, where="the ChatML template of a trained BPE")
        samples = sample_texts(source_files(d), template)  # read only if the BPE is trained
    if is_main:
        tok = load_or_train_tokenizer(d, vocab_size, cache_dir, samples=samples)
        _dataset(cfg, d, tok, tok_dir, cache_dir, "data.path", build=True)
        if val_cfg is not None:
            _dataset(cfg, val_cfg, tok, tok_dir, cache_dir, "data.val_path", build=True)
    barrier()
    tok = load_or_train_tokenizer(d, vocab_size, cache_dir, build=False, samples=samples)
    dataset, kind = _dataset(cfg, d, tok, tok_dir, cache_dir, "data.path", build=False)
    packed = kind == "instruct" and d.packing == "packed"
    train_stats = dataset.stats if kind == "instruct" else None
    val_stats = None
    val_ds = None
    if val_cfg is not None:
        val_ds, _ = _dataset(cfg, val_cfg, tok, tok_dir, cache_dir, "data.val_path", build=False)
        source = repr(d.val_path)
        if isinstance(val_ds, InstructionDataset):
            val_stats = val_ds.stats
    elif d.val_fraction:
        n = len(dataset)
        n_val = max(1, round(n * d.val_fraction))
        if n - n_val < 1:
            raise ConfigError(
                f"data.val_fraction={d.val_fraction} of {n} samples leaves none to train on; "
                "use a smaller fraction or more data"
            )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(VAL_SPLIT_SEED))
        held = np.sort(perm[:n_val].numpy())
        kept = np.sort(perm[n_val:].numpy())
        val_ds, source = Subset(dataset, held), f"{d.val_fraction:g} of data.path"
        if train_stats is not None:  # the held-out samples are not training data
            train_stats = dataset.stats_of(kept, dropped=dataset.stats.dropped)
            val_stats = dataset.stats_of(held)
        dataset = Subset(dataset, kept)
    val = None
    stats: dict = {}
    if val_ds is not None:
        stats["val_samples"] = len(val_ds)
        val = EvalSet(PackedRows(val_ds) if packed else val_ds, source)
    # Text windows in blocks (order.py, the order streaming serves too); samples whole-epoch.
    block = d.shuffle_block if kind == "text" else 0
    loader = GlobalBatchLoader(dataset, layout, dp_rank, t.seed, packed, shuffle_block=block)
    preview = None
    if packed:
        preview = PackingCounts()
        consumed = 0
        for _ in range(PREVIEW_STEPS):
            rows, k = loader.step_rows(consumed)
            preview.add(rows, dataset)
            consumed += k
        preview = preview.to_dict()
    if train_stats is not None:
        stats["train_stats"] = dataclasses.asdict(train_stats)
        stats["train"] = train_stats.to_dict()
    if val_stats is not None:
        stats["val"] = val_stats.to_dict()
        if packed:
            stats["val"]["packing"] = val.dataset.counts.to_dict()
    if kind == "text":
        stats["document_mask"] = d.document_mask
    layout_name = "windows" if kind == "text" else d.packing
    return RunData(loader, tok, val, kind, stats, layout_name, preview, tok_dir)


def check_mixture(cfg: JobConfig, d) -> list:
    """data.mixture's sources as DataConfigs (each path in data.path's place), checked on every
    rank with file names, first lines and shard indexes alone: each is text, exists, and the
    preprocessed ones were made with one tokenizer."""
    sources = parse_mixture(d.mixture)
    for setting, value, fix in (
        ("data.path", d.path, "leave data.path at '' and list every source in data.mixture"),
        ("data.val_fraction", d.val_fraction, "give held-out text as data.val_path"),
    ):
        if value:
            raise ConfigError(f"{setting}={value!r} is set beside data.mixture; {fix}")
    if not d.tokenizer:
        raise ConfigError(
            f"data.tokenizer is '' (a BPE trained on data.path), but data.mixture={d.mixture!r} "
            "has no single corpus to train one on; set data.tokenizer (a preprocessed source's "
            "DIR/tokenizer.json, or a HF model directory)"
        )
    configs, hashes = [], {}
    for src in sources:
        setting = f"data.mixture[{src.name}]"
        sd = dataclasses.replace(d, path=src.path, mixture="", val_path="", val_fraction=0.0)
        hf = src.path.startswith(HF_PREFIX)  # checked by _kind: its spelling, its directory
        if not hf and not pathlib.Path(src.path).expanduser().exists():
            raise ConfigError(
                f"{setting}={src.path!r} does not exist; give a preprocessed shard directory or "
                "a .txt/.jsonl/.parquet file or directory of them"
            )
        if _kind(cfg, sd, setting) != "text":
            raise ConfigError(
                f"{setting}={src.path!r} is {_KIND_NAME['instruct']}; a mixture draws text "
                "windows: give text sources, or train on instruction data through data.path"
            )
        if is_preprocessed(src.path):
            index = open_shards(src.path, setting, check_files=False).index  # `_kind` checked
            hashes[src.name] = index["tokenizer_hash"]
        configs.append(sd)
    if len(set(hashes.values())) > 1:
        listed = ", ".join(f"{n}: {h}" for n, h in hashes.items())
        raise ConfigError(
            f"data.mixture={d.mixture!r}: its sources were tokenized with different tokenizers "
            f"({listed}); tokenize every source with the one data.tokenizer"
        )
    return list(zip(sources, configs, strict=True))


def _mixture_run_data(
    cfg: JobConfig, d, layout: RunLayout, dp_rank: int, is_main: bool, barrier
) -> RunData:  # fmt: skip
    """RunData whose loader draws each sample from one of data.mixture's sources by weight."""
    vocab_size, cache_dir = layout.model.vocab_size, cache_dir_for(cfg)
    tok_dir = d.tokenizer  # required by check_mixture
    sources = check_mixture(cfg, d)
    val_cfg = _text_val_config(cfg, d, "data.mixture")
    load_or_train_tokenizer(d, vocab_size, cache_dir, build=False)
    if is_main:  # inline sources are tokenized once, by this process
        tok = load_or_train_tokenizer(d, vocab_size, cache_dir)
        for src, sd in sources:
            _dataset(cfg, sd, tok, tok_dir, cache_dir, f"data.mixture[{src.name}]", build=True)
        if val_cfg is not None:
            _dataset(cfg, val_cfg, tok, tok_dir, cache_dir, "data.val_path", build=True)
    barrier()
    tok = load_or_train_tokenizer(d, vocab_size, cache_dir, build=False)
    datasets = [
        _dataset(cfg, sd, tok, tok_dir, cache_dir, f"data.mixture[{src.name}]", build=False)[0]
        for src, sd in sources
    ]
    loader = MixtureLoader(
        [s for s, _ in sources], datasets, layout, dp_rank, cfg.train.seed, d.shuffle_block
    )
    stats = {"document_mask": d.document_mask}
    val = _held_out_text(cfg, val_cfg, tok, tok_dir, cache_dir, stats)
    return RunData(loader, tok, val, "text", stats, tokenizer_dir=tok_dir)


def _streamed_mixture_run_data(
    cfg: JobConfig, d, layout: RunLayout, dp_rank: int, all_gather, is_main: bool, barrier,
    readers: tuple[int, int],
) -> RunData:  # fmt: skip
    """RunData of data.mixture whose text sources are streamed (each a WindowStream, read by
    every rank) and whose preprocessed sources are read from their shards, as unstreamed:
    nothing is tokenized before the first step. data.val_path is read as _streaming_run_data
    reads it."""
    sources = check_mixture(cfg, d)  # data.tokenizer is set, every source text
    if readers[1] > 1 and all_gather is None:
        raise ValueError("streaming over several readers needs all_gather over them")
    val_cfg = _text_val_config(cfg, d, "data.mixture")
    gather = all_gather or (lambda obj: [obj])
    cache_dir, tok_dir = cache_dir_for(cfg), d.tokenizer
    tok = load_or_train_tokenizer(d, layout.model.vocab_size, cache_dir, build=False)
    stats = {"document_mask": d.document_mask, "streaming": True}
    val = _held_out_text(cfg, val_cfg, tok, tok_dir, cache_dir, stats, is_main, barrier)
    datasets = []
    for i, (src, sd) in enumerate(sources):
        setting = f"data.mixture[{src.name}]"
        if is_preprocessed(sd.path):  # shards: read at any position, nothing to tokenize
            datasets.append(_dataset(cfg, sd, tok, tok_dir, cache_dir, setting, build=False)[0])
        else:
            seed = source_seed(cfg.train.seed, i)
            stream = WindowStream(sd, tok, cfg.train.seq_len, seed, gather, *readers, setting)
            datasets.append(stream)
    eos = eos_id(tok) if d.document_mask == "on" else None
    loader = MixtureLoader(
        [s for s, _ in sources], datasets, layout, dp_rank, cfg.train.seed, d.shuffle_block, eos
    )
    return RunData(loader, tok, val, "text", stats, tokenizer_dir=tok_dir)


def _streaming_run_data(
    cfg: JobConfig, d, layout: RunLayout, dp_rank: int, all_gather, is_main: bool, barrier,
    readers: tuple[int, int],
) -> RunData:  # fmt: skip
    """RunData whose loader tokenizes data.path on the fly (stream.py); nothing of it is cached.
    data.val_path is read as the other paths read it (tokenized once by the main process, or
    preprocessed shards): a held-out set is small and evaluated whole."""
    why = None
    if is_preprocessed(d.path):
        why = f"data.path={d.path!r} is tokenized already (shards are read directly)"
    elif d.val_fraction:
        why = (
            f"data.val_fraction={d.val_fraction:g} cannot be held out of a stream (it never "
            "holds the corpus to take a fraction of); give held-out text as data.val_path"
        )
    elif not d.tokenizer:
        why = "data.tokenizer is '' and a BPE would be trained on the whole corpus first; set it"
    elif check_kinds(cfg, d, None) != "text":
        why = f"data.path={d.path!r} is instruction data; streaming is for text"
    if why:
        raise ConfigError(f"data.streaming=true: {why}; or leave data.streaming at false")
    if readers[1] > 1 and all_gather is None:
        raise ValueError("streaming over several readers needs all_gather over them")
    val_cfg = _text_val_config(cfg, d, f"data.path={d.path!r}")
    gather = all_gather or (lambda obj: [obj])
    cache_dir = cache_dir_for(cfg)
    tok = load_or_train_tokenizer(d, layout.model.vocab_size, cache_dir, build=False)
    source_files(d, "data.path")  # a missing path is one line now, not in the reader thread
    stats = {"document_mask": d.document_mask, "streaming": True}
    val = _held_out_text(cfg, val_cfg, tok, d.tokenizer, cache_dir, stats, is_main, barrier)
    eos = eos_id(tok) if d.document_mask == "on" else None
    loader = StreamingLoader(
        d, tok, layout, cfg.train.seq_len, dp_rank, gather, eos, cfg.train.seed, readers
    )
    return RunData(loader, tok, val, "text", stats, tokenizer_dir=d.tokenizer)


def build_data(
    cfg: JobConfig, layout: RunLayout, dp_rank: int, is_main: bool, barrier: Callable[[], None]
) -> tuple[GlobalBatchLoader, Tokenizer]:
    """(loader for this dp rank, tokenizer). Every process must call it (it calls barrier())."""
    data = build_run_data(cfg, layout, dp_rank, is_main, barrier)
    return data.loader, data.tokenizer
