"""Offline conversion HF safetensors <-> DCP, one tensor in memory at a time.

HF -> DCP: `dcp.save` is given a state dict of *meta* tensors (shapes and dtypes only) and a
planner whose `resolve_data` reads each tensor from the safetensors file when DCP writes it.
`FileSystemWriter(single_file_per_rank=False)` writes one file per tensor; with a single file per
rank DCP's writer keeps every tensor of the file alive until the file is closed (it collects
them for its optional safetensors output), which would hold the whole model.

DCP -> HF: shard boundaries and headers are computed from the DCP metadata, then each tensor is
loaded alone (`dcp.load` of a one-entry state dict) and appended to its safetensors file.

Peak memory is measured as the growth of the process's peak resident set (Linux VmHWM, reset
at the start through /proc/self/clear_refs; a 2 ms RSS sampler elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid2d.checkpoint.hf import (
    check_tensor_names,
    config_mismatch,
    hf_config_from_model,
    model_config_from_hf,
    read_saved_model_config,
)
from hybrid2d.checkpoint.hf_safetensors import (
    AUX_FILES,
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointError,
    HFCheckpoint,
    TensorSpec,
    load_json,
    plan_shards,
    write_safetensors,
)
from hybrid2d.checkpoint.hf_tokens import (
    GENERATION_CONFIG,
    HF_CONFIG_COPY,
    ExportTokens,
    export_tokens,
    tokenizer_config,
)
from hybrid2d.checkpoint.reader import iter_model_tensors, model_entries, read_metadata
from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.data.chat import TOKENIZER_CONFIG
from hybrid2d.errors import ConfigError

DTYPE_ALIASES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def run_tool(work: Callable[[], str]) -> int:
    """A tool's exit status: 0 after printing what `work` returns; bad input (ConfigError) is
    one `error:` line and 2, an I/O error one line and 1."""
    try:
        print(work())
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


def parse_dtype(text: str | None, allowed=("fp32", "bf16", "fp16")) -> torch.dtype | None:
    """--dtype: one of `allowed` or its long name (float32, ...); None when not given."""
    if not text:
        return None
    dtype = DTYPE_ALIASES.get(text.lower())
    if dtype not in [DTYPE_ALIASES[a] for a in allowed]:
        raise CheckpointError(f"--dtype {text!r} is not one of {', '.join(allowed)}")
    return dtype


# ---- memory ----------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Growth of the resident set's peak over a block of work, in bytes."""

    def __enter__(self) -> PeakMemory:
        self.method, self.growth = "VmHWM", 0
        self._stop, self._thread = threading.Event(), None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self.method = "sampled RSS"
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self.base = self._peak = self._rss()
        if self._thread is not None:
            self._thread.start()
        return self

    def _rss(self) -> int:
        kib = _status_kib("VmRSS")
        if kib is not None:
            return kib * 1024
        import psutil

        return psutil.Process().memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self._rss())

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = self._peak
        else:
            peak = (_status_kib("VmHWM") or 0) * 1024
        self.growth = max(0, peak - self.base)


# ---- shared helpers --------------------------------------------------------------------------


@dataclass
class Summary:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    peak_memory_growth: int = 0
    memory_method: str = ""
    largest_tensor: int = 0
    files: int = 0
    tokens: ExportTokens | None = None  # DCP -> HF of a training checkpoint: its token ids

    def lines(self, title: str) -> str:
        mib = 2**20
        return "\n".join(
            [
                title,
                f"  tensors          {self.tensors}",
                f"  bytes            {self.bytes:,} ({self.bytes / mib:.1f} MiB)",
                f"  files written    {self.files}",
                f"  time             {self.seconds:.2f} s",
                f"  peak memory      +{self.peak_memory_growth / mib:.1f} MiB ({self.memory_method}"
                f" growth; largest tensor {self.largest_tensor / mib:.1f} MiB, model "
                f"{self.bytes / mib:.1f} MiB)",
                *([f"  token ids        {self.tokens.describe()}"] if self.tokens else []),
            ]
        )


@contextlib.contextmanager
def _converting(dst: str, summary: Summary, desc: str, progress: bool):
    """Yield (a sibling temporary directory, a progress callback taking bytes) to write DST's
    files into; the directory is renamed to DST only when all went well and removed on any
    error, so an interrupted conversion never leaves a half-written DST. Fills in the summary's
    time and peak memory."""
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CheckpointError(f"destination {dst} exists and is not empty; choose a new directory")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError(f"destination's parent directory {parent} does not exist")
    tmp = os.path.abspath(dst).rstrip(os.sep) + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=summary.bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    start = time.perf_counter()
    try:
        with PeakMemory() as mem:
            yield tmp, (bar.update if bar is not None else lambda n: None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    if os.path.isdir(dst):
        os.rmdir(dst)  # empty (checked above)
    os.replace(tmp, dst)
    summary.seconds = time.perf_counter() - start
    summary.peak_memory_growth, summary.memory_method = mem.growth, mem.method


def _cast(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: --dtype converts floating-point tensors only."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def _copy_aux(src: str, dst: str) -> None:
    for name in AUX_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


# ---- HF -> DCP -------------------------------------------------------------------------------


def convert_hf_to_dcp(
    src: str, dst: str, dtype: torch.dtype | None = None, progress: bool = True
) -> Summary:
    """Write SRC's weights as DCP {"model": {...}} plus config.json (hybrid2d JobConfig with the
    model derived from SRC), hf_config.json (SRC's config.json) and the tokenizer files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    with HFCheckpoint(src) as ckpt:
        cfg = model_config_from_hf(ckpt.config, os.path.join(src, "config.json"))
        shapes = {n: t.shape for n, t in ckpt.tensors.items()}
        names = check_tensor_names(shapes, cfg, src)
        # DCP name -> HF name it is read from. Training checkpoints of a tied model hold
        # lm_head.weight too (get_model_state_dict keeps both names), so the converted
        # checkpoint does as well, with the embedding's values; the export drops it again.
        sources = dict(zip(names, names, strict=True))
        if cfg.tie_embeddings and "lm_head.weight" not in sources:
            sources["lm_head.weight"] = "model.embed_tokens.weight"

        specs = {
            name: TensorSpec(name, _cast(ckpt.tensors[s].dtype, dtype), ckpt.tensors[s].shape)
            for name, s in sources.items()
        }
        sizes = [s.nbytes for s in specs.values()]
        summary = Summary(tensors=len(specs), bytes=sum(sizes), largest_tensor=max(sizes))
        meta = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
        with _converting(dst, summary, "hf -> dcp", progress) as (tmp, advance):

            class StreamingPlanner(DefaultSavePlanner):
                """Reads each tensor from the safetensors file when DCP is about to write it."""

                def resolve_data(self, write_item):
                    spec = specs[write_item.index.fqn.removeprefix("model.")]
                    advance(spec.nbytes)
                    return ckpt.read(sources[spec.name]).to(spec.dtype)

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save")
                dcp.save(
                    {"model": meta},
                    storage_writer=dcp.FileSystemWriter(
                        tmp, single_file_per_rank=False, thread_count=1, sync_files=False
                    ),
                    planner=StreamingPlanner(),
                    no_dist=True,
                )
            job = JobConfig(recipe="hf-import")
            job.model = cfg
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(job.to_dict(), f, indent=2)
            shutil.copyfile(os.path.join(src, "config.json"), os.path.join(tmp, HF_CONFIG_COPY))
            _copy_aux(src, tmp)
            summary.files = len(os.listdir(tmp))
    return summary


# ---- DCP -> HF -------------------------------------------------------------------------------


def _export_hf_config(src: str) -> tuple[ModelConfig, dict | None]:
    """(model config, source HF config.json or None) for a DCP directory."""
    hf_path = os.path.join(src, HF_CONFIG_COPY)
    saved = read_saved_model_config(src)
    if not os.path.isfile(hf_path):
        if saved is None:
            raise CheckpointError(
                f"{src} has no config.json with a model section (nor {HF_CONFIG_COPY}); cannot "
                "write a Hugging Face config"
            )
        return saved, None
    hf = load_json(hf_path)
    cfg = model_config_from_hf(hf, hf_path)
    bad = config_mismatch(cfg, saved) if saved is not None else ()
    if bad:
        name, key, a, b = bad
        raise CheckpointError(
            f"{src}: {HF_CONFIG_COPY} {key}={a} disagrees with config.json model.{name}={b}"
        )
    return cfg, hf


def convert_dcp_to_hf(
    src: str,
    dst: str,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> Summary:
    """Write SRC's "model" entry as size-capped safetensors shards, an index, config.json and
    the tokenizer files found in SRC."""
    meta = read_metadata(Path(src))
    found = model_entries(meta, src)
    cfg, hf = _export_hf_config(src)
    names = check_tensor_names({n: tuple(t.size) for n, t in found.items()}, cfg, src)
    if cfg.tie_embeddings:
        names = [n for n in names if n != "lm_head.weight"]  # HF omits the tied head
    specs = [
        TensorSpec(n, _cast(found[n].properties.dtype, dtype), tuple(found[n].size)) for n in names
    ]
    shards = plan_shards(specs, max_shard_bytes)
    total = sum(s.nbytes for s in specs)
    summary = Summary(len(specs), total, largest_tensor=max(s.nbytes for s in specs))
    summary.files = len(shards)
    tensors = iter_model_tensors(Path(src), meta, names)  # in the order the shards ask for them
    weight_map = {}
    with _converting(dst, summary, "dcp -> hf", progress) as (tmp, advance):

        def produce(spec: TensorSpec) -> torch.Tensor:
            advance(spec.nbytes)
            return next(tensors)[1].to(spec.dtype)

        for k, shard in enumerate(shards):
            fname = (
                SINGLE_NAME
                if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            write_safetensors(os.path.join(tmp, fname), shard, produce, {"format": "pt"})
            weight_map.update(dict.fromkeys((s.name for s in shard), fname))
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2)
        out_dtype = specs[0].dtype if specs else torch.float32
        if hf is not None:  # a conversion: the source's config (and generation config) as is
            config = dict(hf)
            for key in ("torch_dtype", "dtype"):  # but the dtype of what is written (a bf16
                if key in config:  # DCP of an fp32 source loaded in fp32, doubling its memory)
                    config[key] = str(out_dtype).removeprefix("torch.")
        else:  # a training checkpoint: the token ids of the model it started from, or its own
            summary.tokens = export_tokens(src, cfg)
            config = hf_config_from_model(cfg, out_dtype) | summary.tokens.config
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        _copy_aux(src, tmp)
        if summary.tokens is not None:
            with open(os.path.join(tmp, GENERATION_CONFIG), "w") as f:
                json.dump(summary.tokens.generation, f, indent=2)
            tok_config = tokenizer_config(Path(src), summary.tokens, cfg)
            if tok_config is not None:
                with open(os.path.join(tmp, TOKENIZER_CONFIG), "w") as f:
                    json.dump(tok_config, f, indent=2)
    return summary
