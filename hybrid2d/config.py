"""Every setting of a run as dataclasses, the command line over them, and validation.

A recipe gives a complete `JobConfig`; the command line changes single fields with
`--section.field value`, parsed by tyro over these dataclasses (the comment above or beside a
field is its `--help` text). Bad input is reported as one `ConfigError` line naming the setting,
its value and what would work, before any process group or model exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import math
import typing
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A setting is wrong; the message is one line naming it and what would work."""


# Settings that older runs' and checkpoints' config.json files hold but hybrid2d no longer has:
# `JobConfig.from_dict` drops them without a word; on the command line they are an error that
# says the setting is gone. While a field of this name still exists it is an ordinary setting.
RETIRED_KEYS = ("parallel.fused_projections", "parallel.local_norms", "parallel.direct_sp_comm")


@dataclass
class ModelConfig:
    """Shape of a Llama-family model; field meanings follow HF `LlamaConfig`."""

    # Model family name (informational).
    name: str = "llama"
    # Hidden size (HF hidden_size).
    dim: int = 256
    # Transformer blocks (HF num_hidden_layers).
    n_layers: int = 4
    # Attention heads (HF num_attention_heads); must divide dim.
    n_heads: int = 8
    # Key/value heads for grouped-query attention (HF num_key_value_heads); divides n_heads.
    n_kv_heads: int = 4
    # MLP hidden size (HF intermediate_size).
    ffn_dim: int = 688
    # Vocabulary size; the tokenizer is trained to this size when none is given.
    vocab_size: int = 4096
    # RMSNorm epsilon (HF rms_norm_eps).
    norm_eps: float = 1e-5
    # RoPE base frequency.
    rope_theta: float = 10000.0
    # llama3 frequency scaling; rope_scaling_factor == 0 means none.
    rope_scaling_factor: float = 0.0
    # llama3 RoPE scaling: low_freq_factor.
    rope_low_freq_factor: float = 1.0
    # llama3 RoPE scaling: high_freq_factor (larger than low_freq_factor).
    rope_high_freq_factor: float = 4.0
    # llama3 RoPE scaling: original_max_position_embeddings.
    rope_original_max_position: int = 8192
    # Longest sequence the model is meant for (HF max_position_embeddings).
    max_position_embeddings: int = 2048
    # Share the embedding matrix with the output head (Llama 3.2 1B/3B).
    tie_embeddings: bool = False
    # Standard deviation of the normal initialization of the weights.
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else emb
        return self.n_layers * block + emb + head + self.dim


@dataclass
class ParallelConfig:
    """Mesh sizes. -1 for dp_shard means: whatever the world size leaves after the others."""

    # HSDP: replicas of the FSDP-sharded model (usually the number of nodes).
    dp_replicate: int = 1
    # FSDP shards; -1: world size / (dp_replicate x tp).
    dp_shard: int = -1
    # Tensor-parallel ranks (innermost mesh axis, keep it inside a node).
    tp: int = 1
    # FSDP2 reshard_after_forward for blocks (the root is never resharded after forward).
    reshard_after_forward: bool = True
    # FSDP2 explicit prefetch: all-gather this many blocks ahead (0: FSDP2's implicit default).
    fsdp_prefetch: int = 0
    # "auto": bf16 params with fp32 reduce on CUDA, fp32 on CPU.
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    # none | full (recompute whole blocks) | selective (recompute only elementwise ops)
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    # torch.compile each transformer block.
    compile: bool = False
    # CPU only: tp and FSDP collectives among ranks of one host through shared memory instead
    # of gloo's loopback TCP. auto: where possible; on: an error where not possible; off.
    shm_collectives: Literal["auto", "on", "off"] = "auto"
    # Gradient accumulation: reduce-scatter once per step instead of once per micro batch, at
    # the cost of holding unsharded gradients between micro batches.
    defer_grad_sync: bool = False
    # Collective timeout in seconds; a dead peer surfaces as an error after this long instead
    # of a hang.
    timeout_s: int = 600
    # manual: mesh, checkpointing and micro batch as set; auto: the planner's best plan for the
    # launched world size (the start line says which it took; tools/plan.py shows the ranking).
    plan: Literal["manual", "auto"] = "manual"
    # The planner's hardware profile (start-of-run prediction and plan=auto): a preset (h100,
    # h200, a100-80gb, b200, cpu), a JSON file from tools/plan.py --calibrate, or "" for this
    # machine's (its CUDA device's preset, else an uncalibrated CPU guess).
    plan_hardware: str = ""


@dataclass
class TrainConfig:
    """Optimization: steps, batch, learning rate schedule, optimizer."""

    # Optimizer steps to train for.
    steps: int = 200
    # Sequences per step over all data-parallel ranks.
    global_batch: int = 8
    micro_batch: int = 0  # 0: the whole per-dp-rank batch at once (no accumulation)
    # Tokens per sequence.
    seq_len: int = 256
    # Peak learning rate (after warmup).
    lr: float = 3e-3
    # Learning rate at the last step, as a fraction of lr (cosine decay).
    min_lr_ratio: float = 0.1
    # Steps of linear warmup from 0 to lr.
    warmup_steps: int = 20
    # AdamW weight decay on matrices (norm weights are not decayed).
    weight_decay: float = 0.1
    # AdamW beta1.
    beta1: float = 0.9
    # AdamW beta2.
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    optimizer: Literal["adamw", "sgd"] = "adamw"  # adamw | sgd
    # A non-finite loss or grad norm: "stop" the run before the update, or "skip" the update.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # Seed of the weight initialization and of the data order.
    seed: int = 0
    # Validation loss every N steps (and after the last step) when there is validation data
    # (data.val_path or data.val_fraction); 0: only after the last step.
    eval_every: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    """Training text and tokenizer."""

    # A .txt/.jsonl/.parquet file or a directory of them; "" means the built-in corpus
    # (the Python standard library's sources, present wherever Python is).
    path: str = ""
    # The field holding the text in .jsonl and .parquet files.
    text_field: str = "text"
    # tokenizer.json or a HF model directory; "" trains a byte-level BPE of the model's vocab
    # size on the corpus and caches it.
    tokenizer: str = ""
    cache_dir: str = ""  # "" -> ~/.cache/hybrid2d
    # Characters of the built-in corpus to use (0: all of it). Keeps the CPU default quick.
    max_chars: int = 4_000_000
    # auto: .jsonl files whose first line has prompt/completion or messages are instruction
    # data (one padded sample per line, loss on the completion / assistant turns), anything
    # else text; text | instruct force one.
    format: Literal["auto", "text", "instruct"] = "auto"
    # Held-out data for validation, in data.path's formats ("": none, or data.val_fraction).
    val_path: str = ""
    # Fraction of data.path's samples held out for validation when data.val_path is "" (0: none).
    val_fraction: float = 0.0


@dataclass
class MetricsConfig:
    """Run directory and what is logged."""

    # Where the run writes config.json, summary.json, TensorBoard events and checkpoints;
    # {recipe} and {time} are filled in.
    run_dir: str = "runs/{recipe}-{time}"
    # Log every N steps (the last step is always logged).
    log_every: int = 1
    # Write TensorBoard events under the run directory.
    tensorboard: bool = True
    # Show a progress bar on rank 0.
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    """Saving, resuming and initializing from checkpoints."""

    every: int = 0  # save every N steps; 0: only at the end (when enabled)
    # Save a checkpoint after the last step (on by default: every finished run can be
    # generated from, exported and resumed).
    save_final: bool = True
    # Keep the newest N checkpoints of the run, delete older ones.
    keep_last: int = 3
    # Write checkpoints from a background thread while training goes on.
    async_save: bool = False
    resume: str = ""  # "" (none) | auto | path of a step directory (or of a run directory)
    # Save a checkpoint after this step and stop (a job's time slot ends); 0: run to train.steps.
    stop_after: int = 0
    init_from: str = ""  # "" | hf:PATH | dcp:PATH


@dataclass
class ProfileConfig:
    """Memory profiling."""

    # Per step and rank memory by category (parameters, gradients, optimizer, activations,
    # communication); memory/* in TensorBoard and a report at the end.
    memory: bool = False
    # CUDA: dump the allocator's snapshot for https://pytorch.org/memory_viz.
    snapshot: bool = False


@dataclass
class JobConfig:
    """hybrid2d trainer settings; the defaults shown are those of the chosen --recipe."""

    recipe: str = "llama-debug"  # a name from --list; its values are the defaults shown here
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> JobConfig:
        """The config a `to_dict()` (a run's or checkpoint's config.json) describes.

        Missing settings keep their defaults; an unknown section or setting is a ConfigError
        naming it and the closest valid one, except the RETIRED_KEYS, which are dropped.
        Values of the wrong type are a ConfigError too (ints are accepted for floats).
        """
        cfg = cls()
        sections = {f.name for f in dataclasses.fields(cfg)}
        for section, values in d.items():
            if section not in sections:
                raise ConfigError(
                    f"unknown section {section!r} in a saved config; {_closest(section, sections)}"
                )
            current = getattr(cfg, section)
            if not dataclasses.is_dataclass(current):
                setattr(cfg, section, _typed(section, _hints(type(cfg))[section], values))
                continue
            if not isinstance(values, dict):
                raise ConfigError(
                    f"section {section!r} of a saved config is {type(values).__name__} "
                    f"{values!r}; expected a mapping of its settings"
                )
            hints = _hints(type(current))
            for k, v in values.items():
                key = f"{section}.{k}"
                if k not in hints:
                    if key in RETIRED_KEYS:
                        continue  # an older config's setting that no longer exists
                    leaves = [n for n in _leaf_fields(cfg) if n not in RETIRED_KEYS]
                    raise ConfigError(
                        f"unknown setting {key!r} in a saved config; {_closest(key, leaves)}"
                    )
                setattr(current, k, _typed(key, hints[k], v))
        return cfg

    # ---- validation -------------------------------------------------------------------------

    def resolve_mesh(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) for this world size, or a ConfigError naming the problem."""
        p = self.parallel
        for name in ("dp_replicate", "tp"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % (p.dp_replicate * p.tp):
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate x "
                    f"parallel.tp = {p.dp_replicate} x {p.tp}; pick tp among "
                    f"{_divisors(world_size)}"
                )
            dp_shard = world_size // (p.dp_replicate * p.tp)
        if dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard={dp_shard} must be >= 1 (or -1 for auto)")
        if p.dp_replicate * dp_shard * p.tp != world_size:
            raise ConfigError(
                f"world size {world_size} != parallel.dp_replicate x parallel.dp_shard x "
                f"parallel.tp = {p.dp_replicate} x {dp_shard} x {p.tp}; set parallel.dp_shard=-1 "
                f"or sizes whose product is {world_size}"
            )
        return p.dp_replicate, dp_shard, p.tp

    def check_settings(self) -> None:
        """Every setting on its own: its type, its choices, and its range (finite numbers)."""
        for name, (owner, f) in _leaf_fields(self).items():
            value = _typed(name, _hints(type(owner))[f.name], getattr(owner, f.name))
            check_range(name, value)
        m = self.model
        if m.rope_scaling_factor > 0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be larger than "
                f"model.rope_low_freq_factor={m.rope_low_freq_factor} when "
                f"model.rope_scaling_factor={m.rope_scaling_factor} (llama3 uses 4 and 1)"
            )

    def validate(self, world_size: int) -> tuple[int, int, int]:
        """Check every setting that can be checked without a process group; return the mesh."""
        self.check_settings()
        m, t = self.model, self.train
        dp_rep, dp_shard, tp = self.resolve_mesh(world_size)
        dp = dp_rep * dp_shard
        for what, value in (
            ("model.n_heads", m.n_heads),
            ("model.n_kv_heads", m.n_kv_heads),
            ("model.ffn_dim", m.ffn_dim),
            ("model.vocab_size", m.vocab_size),
        ):
            if value % tp:
                raise ConfigError(
                    f"parallel.tp={tp} does not divide {what}={value}; use tp in "
                    f"{[d for d in _divisors(value) if d <= world_size]}"
                )
        if m.dim % m.n_heads:
            raise ConfigError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}"
            )
        if t.seq_len % tp:
            raise ConfigError(
                f"train.seq_len={t.seq_len} is not divisible by parallel.tp={tp} "
                f"(sequence parallel splits the sequence); use a multiple of {tp}"
            )
        if t.global_batch % dp:
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by the data-parallel size "
                f"{dp} (dp_replicate x dp_shard); use a multiple of {dp}"
            )
        d = self.data
        if d.val_path and d.val_fraction:
            raise ConfigError(
                f"data.val_path={d.val_path!r} and data.val_fraction={d.val_fraction} both name "
                "validation data; set one of them"
            )
        if t.eval_every and not (d.val_path or d.val_fraction):
            raise ConfigError(
                f"train.eval_every={t.eval_every} needs validation data; set data.val_path or "
                "data.val_fraction"
            )
        local = t.global_batch // dp
        if t.micro_batch and local % t.micro_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} does not divide the per-rank batch {local} "
                f"(global_batch / dp); use one of {_divisors(local)} or 0"
            )
        return dp_rep, dp_shard, tp


def resolve_mixed_precision(setting: str, device_type: str) -> str:
    """The compute precision parallel.mixed_precision means on this device: "bf16" or "fp32".

    "auto" is bf16 parameters and activations (with fp32 gradient reduction) on CUDA and fp32
    on every other device; "bf16" and "fp32" mean themselves everywhere.
    """
    if setting == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    if setting in ("bf16", "fp32"):
        return setting
    raise ConfigError(f"parallel.mixed_precision={setting!r} is not one of 'auto', 'bf16', 'fp32'")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


# ---- what each number may be -----------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """An interval of allowed values, with optional single extra values (dp_shard's -1)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple = ()
    note: str = ""

    def __contains__(self, v) -> bool:
        if v in self.also:
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"in {left}{self.lo}, {self.hi}{right}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {self.lo}"
        else:
            text = f"{'<' if self.hi_open else '<='} {self.hi}"
        extra = "".join(f" or {a}" for a in self.also)
        return text + extra + (f" ({self.note})" if self.note else "")


_POSITIVE = Range(0, lo_open=True)
_AT_LEAST_1 = Range(1)
_NON_NEGATIVE = Range(0)
_FRACTION = Range(0, 1)
_BETA = Range(0, 1, hi_open=True)

# Every int and float setting and what it may be (tests check that none is missing).
LIMITS: dict[str, Range] = {
    "model.dim": _AT_LEAST_1,
    "model.n_layers": _AT_LEAST_1,
    "model.n_heads": _AT_LEAST_1,
    "model.n_kv_heads": _AT_LEAST_1,
    "model.ffn_dim": _AT_LEAST_1,
    "model.vocab_size": _AT_LEAST_1,
    "model.norm_eps": _POSITIVE,
    "model.rope_theta": _POSITIVE,
    "model.rope_scaling_factor": Range(0, note="0: no scaling"),
    "model.rope_low_freq_factor": _POSITIVE,
    "model.rope_high_freq_factor": _POSITIVE,
    "model.rope_original_max_position": _AT_LEAST_1,
    "model.max_position_embeddings": _AT_LEAST_1,
    "model.init_std": _POSITIVE,
    "parallel.dp_replicate": _AT_LEAST_1,
    "parallel.dp_shard": Range(1, also=(-1,), note="-1: what the world size leaves"),
    "parallel.tp": _AT_LEAST_1,
    "parallel.fsdp_prefetch": _NON_NEGATIVE,
    "parallel.timeout_s": Range(1, 10**9),
    "train.steps": _AT_LEAST_1,
    "train.global_batch": _AT_LEAST_1,
    "train.micro_batch": Range(0, note="0: no accumulation"),
    "train.seq_len": _AT_LEAST_1,
    "train.lr": _POSITIVE,
    "train.min_lr_ratio": _FRACTION,
    "train.warmup_steps": _NON_NEGATIVE,
    "train.weight_decay": _NON_NEGATIVE,
    "train.beta1": _BETA,
    "train.beta2": _BETA,
    "train.grad_clip": Range(0, note="0: no clipping"),
    "train.seed": Range(0, 2**63, hi_open=True),
    "data.max_chars": Range(0, note="0: all of it"),
    "data.val_fraction": Range(0, 0.5, hi_open=True, note="0: no held-out part"),
    "train.eval_every": Range(0, note="0: only after the last step"),
    "metrics.log_every": _AT_LEAST_1,
    "checkpoint.every": Range(0, note="0: only at the end"),
    "checkpoint.keep_last": _AT_LEAST_1,
    "checkpoint.stop_after": Range(0, note="0: off"),
}


def check_range(name: str, value) -> None:
    """A ConfigError unless the value of setting `name` is in its range (numbers only)."""
    limit = LIMITS.get(name)
    if limit is None or value in limit:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value} is not a finite number; use a value {limit}")
    raise ConfigError(f"{name}={value} is out of range; use a value {limit}")


# ---- types ------------------------------------------------------------------------------------


def _hints(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _choices(kind) -> tuple | None:
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _kind_text(kind) -> str:
    choices = _choices(kind)
    if choices is not None:
        return "one of " + ", ".join(repr(c) for c in choices)
    return {bool: "true or false", int: "an integer", float: "a number", str: "text"}[kind]


def _typed(name: str, kind, value):
    """`value` (from Python or JSON) as a value of `kind`, or a ConfigError naming `name`."""
    choices = _choices(kind)
    if choices is not None:
        ok = isinstance(value, str) and value in choices
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    elif kind in (int, float):
        ok = isinstance(value, kind) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{name}={value!r} is not {_kind_text(kind)}")
    return value


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_value(name: str, kind, text: str):
    """Command-line text for setting `name` of type `kind` as a checked value (type, choices
    and range), or a ConfigError naming the setting, the text and what would work."""
    choices = _choices(kind)
    try:
        if choices is not None:
            if text not in choices:
                raise ValueError(text)
            value = text
        elif kind is bool:
            value = _parse_bool(text)
        else:
            value = kind(text.strip()) if kind in (int, float) else text
    except ValueError:
        raise ConfigError(f"--{name}={text!r} is not {_kind_text(kind)}") from None
    check_range(name, value)
    return value


def _closest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.0)
    return f"the closest valid one is {close[0]!r}" if close else "none is valid here"


# ---- command line ----------------------------------------------------------------------------


def _leaf_fields(cfg: JobConfig) -> dict[str, tuple[object, dataclasses.Field]]:
    """'section.field' -> (owning dataclass instance, field) for every overridable setting."""
    out = {}
    for top in dataclasses.fields(cfg):
        value = getattr(cfg, top.name)
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                out[f"{top.name}.{f.name}"] = (value, f)
    return out


def setting_names(cfg: JobConfig | None = None) -> list[str]:
    """Every 'section.field' the command line can set."""
    return list(_leaf_fields(cfg or JobConfig()))


def _split_args(args: list[str], leaves: dict) -> list[tuple[str, str]]:
    """[(dotted name, value text)] of `--section.field value` / `--section.field=value` pairs.
    A boolean flag without a value means true. Unknown names are a ConfigError."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; settings look like --train.steps 50")
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")  # tyro's spelling (--train.global-batch) works too
        if key not in leaves:
            if key in RETIRED_KEYS:
                raise ConfigError(
                    f"--{key} was removed (hybrid2d now always does what it enabled); drop it"
                )
            close = _closest_setting(key, list(leaves))
            hint = f"did you mean --{close}?" if close else "--help lists the settings"
            raise ConfigError(f"unknown setting --{key}; {hint}")
        owner, f = leaves[key]
        kind = _hints(type(owner))[f.name]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if eq:
            i += 1
        elif kind is bool and (nxt is None or nxt.startswith("--")):
            text, i = "true", i + 1
        elif nxt is None or nxt.startswith("--"):
            raise ConfigError(
                f"--{key} needs a value ({_kind_text(kind)}), e.g. --{key} "
                f"{_cli_text(getattr(owner, f.name)) or '...'}"
            )
        else:
            text, i = nxt, i + 2
        out.append((key, text))
    return out


def _closest_setting(key: str, names: list[str]) -> str | None:
    """The valid dotted name closest to `key`: the same field in another section (--lr ->
    train.lr), else the most similar full name, else the most similar field name."""
    field_name = key.rsplit(".", 1)[-1]
    same_field = [n for n in names if n.rsplit(".", 1)[-1] == field_name]
    if len(same_field) == 1:
        return same_field[0]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if close:
        return close[0]
    by_field = {n.rsplit(".", 1)[-1]: n for n in names}
    close = difflib.get_close_matches(field_name, list(by_field), n=1, cutoff=0.6)
    return by_field[close[0]] if close else None


def _cli_text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


_TYRO_ERROR = "the command line could not be parsed"


def _tyro(cfg: JobConfig, args: list[str]) -> JobConfig:
    """tyro's parse of `args` over `cfg`'s values. Its own error output (a framed message and
    usage) is caught: a ConfigError carries the first line that names a problem."""
    import tyro

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return tyro.cli(
                JobConfig,
                args=args,
                default=cfg,
                use_underscores=True,
                config=(tyro.conf.FlagConversionOff,),
            )
    except SystemExit:
        text = err.getvalue() + out.getvalue()
        lines = [ln.strip(" │╭╮╰╯─") for ln in text.splitlines()]
        useful = [ln for ln in lines if ln and ("rror" in ln or "nrecognized" in ln)]
        detail = " ".join((useful or [ln for ln in lines if ln] or ["no detail"])[0].split())
        raise ConfigError(f"{_TYRO_ERROR} ({' '.join(args)}): {detail}") from None


def apply_overrides(cfg: JobConfig, args: list[str]) -> set[str]:
    """Apply `--section.field value` pairs (or `--section.field=value`) to cfg in place.

    Returns the dotted names that were set. Every value is checked first (unknown names with
    the closest valid one, wrong types, choices, non-finite or out-of-range numbers: one
    ConfigError line each); tyro then parses the checked values over cfg's dataclasses.
    """
    leaves = _leaf_fields(cfg)
    values: dict[str, object] = {}
    for key, text in _split_args(list(args), leaves):
        owner, f = leaves[key]
        values[key] = parse_value(key, _hints(type(owner))[f.name], text)
    if not values:
        return set()
    parsed = _tyro(cfg, [f"--{k}={_tyro_text(v)}" for k, v in values.items()])
    for key in values:
        owner, f = leaves[key]
        section = key.split(".", 1)[0]
        setattr(owner, f.name, getattr(getattr(parsed, section), f.name))
    return set(values)


def _tyro_text(value) -> str:
    return ("True" if value else "False") if isinstance(value, bool) else _cli_text(value)


def print_help(cfg: JobConfig, prog: str | None = None, description: str | None = None) -> None:
    """tyro's --help for every setting, with its help text and cfg's value as the default."""
    import tyro

    with contextlib.suppress(SystemExit):
        tyro.cli(
            JobConfig,
            prog=prog,
            description=description,
            args=["--help"],
            default=cfg,
            use_underscores=True,
            config=(tyro.conf.FlagConversionOff,),
        )


def describe(cfg: JobConfig) -> str:
    """Every setting with its current value, one per line (for --help-config)."""
    lines = []
    for name, (owner, f) in _leaf_fields(cfg).items():
        lines.append(f"--{name} {getattr(owner, f.name)!r}")
    return "\n".join(lines)
