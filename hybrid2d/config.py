"""Every setting of a run as dataclasses, CLI overrides by dotted name, and validation.

A recipe gives a complete `JobConfig`; the command line changes single fields with
`--section.field value`. Bad input is reported as one `ConfigError` line naming the setting,
its value and what would work, before any process group or model exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A setting is wrong; the message is one line naming it and what would work."""


@dataclass
class ModelConfig:
    """Shape of a Llama-family model; field meanings follow HF `LlamaConfig`."""

    name: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 688
    vocab_size: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 frequency scaling; rope_scaling_factor == 0 means none.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
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

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    # FSDP2 reshard_after_forward for blocks (the root is never resharded after forward).
    reshard_after_forward: bool = True
    # FSDP2 explicit prefetch: all-gather this many blocks ahead (0: FSDP2's implicit default).
    fsdp_prefetch: int = 0
    # "auto": bf16 params with fp32 reduce on CUDA, fp32 on CPU.
    mixed_precision: str = "auto"
    # none | full (recompute whole blocks) | selective (recompute only elementwise ops)
    activation_checkpoint: str = "none"
    compile: bool = False
    # q/k/v and gate/up as one local matmul each (same parameters, same HF names).
    fused_projections: bool = True
    # Sequence-parallel norms on plain local tensors instead of DTensors (fewer dispatches).
    local_norms: bool = True
    # Blocks gather / reduce-scatter the sequence with plain collectives instead of DTensor
    # redistributions (implies fused projections and local norms inside blocks).
    direct_sp_comm: bool = True
    # CPU only: tp and FSDP collectives among ranks of one host through shared memory instead
    # of gloo's loopback TCP. auto: where possible; on: an error where not possible; off.
    shm_collectives: str = "auto"
    # Gradient accumulation: reduce-scatter once per step instead of once per micro batch, at
    # the cost of holding unsharded gradients between micro batches.
    defer_grad_sync: bool = False
    # Collective timeout; a dead peer surfaces as an error after this long instead of a hang.
    timeout_s: int = 600


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 8
    micro_batch: int = 0  # 0: the whole per-dp-rank batch at once (no accumulation)
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    optimizer: str = "adamw"  # adamw | sgd
    # A non-finite loss or grad norm: "stop" the run before the update, or "skip" the update.
    on_nonfinite: str = "stop"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    # A .txt/.jsonl/.parquet file or a directory of them; "" means the built-in corpus
    # (the Python standard library's sources, present wherever Python is).
    path: str = ""
    text_field: str = "text"
    # tokenizer.json or a HF model directory; "" trains a byte-level BPE of the model's vocab
    # size on the corpus and caches it.
    tokenizer: str = ""
    cache_dir: str = ""  # "" -> ~/.cache/hybrid2d
    # Characters of the built-in corpus to use (0: all of it). Keeps the CPU default quick.
    max_chars: int = 4_000_000


@dataclass
class MetricsConfig:
    run_dir: str = "runs/{recipe}-{time}"
    log_every: int = 1
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0: only at the end (when enabled)
    save_final: bool = False
    keep_last: int = 3
    async_save: bool = False
    resume: str = ""  # "" (none) | auto | path of a step directory (or of a run directory)
    # Save a checkpoint after this step and stop (a job's time slot ends); 0: run to train.steps.
    stop_after: int = 0
    init_from: str = ""  # "" | hf:PATH | dcp:PATH


@dataclass
class ProfileConfig:
    memory: bool = False
    snapshot: bool = False


@dataclass
class JobConfig:
    recipe: str = "llama-debug"
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
        cfg = cls()
        for section, values in d.items():
            if isinstance(values, dict):
                sub = getattr(cfg, section)
                for k, v in values.items():
                    if hasattr(sub, k):
                        setattr(sub, k, v)
            elif hasattr(cfg, section):
                setattr(cfg, section, values)
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

    def validate(self, world_size: int) -> tuple[int, int, int]:
        """Check every setting that can be checked without a process group; return the mesh."""
        m, p, t = self.model, self.parallel, self.train
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
        if t.seq_len < 1:
            raise ConfigError(f"train.seq_len={t.seq_len} must be >= 1")
        if t.global_batch % dp:
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by the data-parallel size "
                f"{dp} (dp_replicate x dp_shard); use a multiple of {dp}"
            )
        local = t.global_batch // dp
        if t.micro_batch < 0 or (t.micro_batch and local % t.micro_batch):
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} does not divide the per-rank batch {local} "
                f"(global_batch / dp); use one of {_divisors(local)} or 0"
            )
        if t.steps < 1:
            raise ConfigError(f"train.steps={t.steps} must be >= 1")
        if t.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"train.optimizer={t.optimizer!r} is not one of 'adamw', 'sgd'")
        if t.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"train.on_nonfinite={t.on_nonfinite!r} is not one of stop, skip")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device={t.device!r} is not one of 'auto', 'cpu', 'cuda'")
        if p.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(
                f"parallel.mixed_precision={p.mixed_precision!r} is not one of auto, bf16, fp32"
            )
        if p.activation_checkpoint not in ("none", "full", "selective"):
            raise ConfigError(
                f"parallel.activation_checkpoint={p.activation_checkpoint!r} is not one of "
                "none, full, selective"
            )
        if p.fsdp_prefetch < 0:
            raise ConfigError(f"parallel.fsdp_prefetch={p.fsdp_prefetch} must be >= 0")
        if p.shm_collectives not in ("auto", "on", "off"):
            raise ConfigError(
                f"parallel.shm_collectives={p.shm_collectives!r} is not one of auto, on, off"
            )
        if t.lr <= 0:
            raise ConfigError(f"train.lr={t.lr} must be > 0")
        if t.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
        if self.checkpoint.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.checkpoint.keep_last} must be >= 1")
        for name in ("every", "stop_after"):
            if getattr(self.checkpoint, name) < 0:
                value = getattr(self.checkpoint, name)
                raise ConfigError(f"checkpoint.{name}={value} must be >= 0 (0: off)")
        return dp_rep, dp_shard, tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


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


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _converter(owner: object, f: dataclasses.Field):
    hints = typing.get_type_hints(type(owner))
    kind = hints[f.name]
    return {bool: _parse_bool, int: int, float: float, str: str}[kind], kind.__name__


def apply_overrides(cfg: JobConfig, args: list[str]) -> set[str]:
    """Apply `--section.field value` pairs (or `--section.field=value`) to cfg in place.

    Returns the dotted names that were set. Unknown keys and values of the wrong type raise a
    ConfigError naming the key, the closest valid keys, or the expected type.
    """
    leaves = _leaf_fields(cfg)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in leaves:
        parser.add_argument(f"--{name}", dest=name, default=None)
    known, unknown = parser.parse_known_args(args)
    for arg in unknown:
        if arg.startswith("--"):
            key = arg[2:].split("=", 1)[0]
            close = difflib.get_close_matches(key, leaves, n=3, cutoff=0.5)
            hint = (
                f"did you mean {', '.join('--' + c for c in close)}?"
                if close
                else ("run with --help-config to list the settings")
            )
            raise ConfigError(f"unknown setting --{key}; {hint}")
        raise ConfigError(f"unexpected argument {arg!r}; settings look like --train.steps 50")
    changed = set()
    for name, text in vars(known).items():
        if text is None:
            continue
        owner, f = leaves[name]
        convert, type_name = _converter(owner, f)
        try:
            value = convert(text)
        except ValueError:
            raise ConfigError(f"--{name}={text!r} is not a valid {type_name}") from None
        setattr(owner, f.name, value)
        changed.add(name)
    return changed


def describe(cfg: JobConfig) -> str:
    """Every setting with its current value, one per line (for --help-config)."""
    lines = []
    for name, (owner, f) in _leaf_fields(cfg).items():
        lines.append(f"--{name} {getattr(owner, f.name)!r}")
    return "\n".join(lines)
