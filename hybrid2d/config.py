"""Every setting of a run as dataclasses, and their validation.

A recipe gives a complete `JobConfig`; the comment above or beside a field is its `--help`
text, the `Range` in its annotation what the number may be. Bad input is reported as one
`ConfigError` line naming the setting, its value and what would work, before any process group
or model exists. The command line over these dataclasses is `cli.py`'s: this module imports no
parser, so the rooms that only read settings (models, data, shm_backend) do not load one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

from hybrid2d.errors import ConfigError

# Settings that older runs' and checkpoints' config.json files hold but hybrid2d no longer has:
# `JobConfig.from_dict` drops them without a word; on the command line they are an error that
# says the setting is gone. While a field of this name still exists it is an ordinary setting.
RETIRED_KEYS = ("parallel.fused_projections", "parallel.local_norms", "parallel.direct_sp_comm")


# ---- what each number may be: every int and float field carries a Range --------------------


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


@dataclass
class ModelConfig:
    """Shape of a decoder model; field meanings follow HF `LlamaConfig`. From `family` on, the
    switches by which the other families differ from Llama, each set from a config.json."""

    # Model family name (informational).
    name: str = "llama"
    # Hidden size (HF hidden_size).
    dim: Annotated[int, _AT_LEAST_1] = 256
    # Transformer blocks (HF num_hidden_layers).
    n_layers: Annotated[int, _AT_LEAST_1] = 4
    # Attention heads (HF num_attention_heads); must divide dim.
    n_heads: Annotated[int, _AT_LEAST_1] = 8
    # Key/value heads for grouped-query attention (HF num_key_value_heads); divides n_heads.
    n_kv_heads: Annotated[int, _AT_LEAST_1] = 4
    # MLP hidden size (HF intermediate_size).
    ffn_dim: Annotated[int, _AT_LEAST_1] = 688
    # Vocabulary size; the tokenizer is trained to this size when none is given.
    vocab_size: Annotated[int, _AT_LEAST_1] = 4096
    # RMSNorm epsilon (HF rms_norm_eps).
    norm_eps: Annotated[float, _POSITIVE] = 1e-5
    # RoPE base frequency.
    rope_theta: Annotated[float, _POSITIVE] = 10000.0
    # llama3 frequency scaling; rope_scaling_factor == 0 means none.
    rope_scaling_factor: Annotated[float, Range(0, note="0: no scaling")] = 0.0
    # llama3 RoPE scaling: low_freq_factor.
    rope_low_freq_factor: Annotated[float, _POSITIVE] = 1.0
    # llama3 RoPE scaling: high_freq_factor (larger than low_freq_factor).
    rope_high_freq_factor: Annotated[float, _POSITIVE] = 4.0
    # llama3 RoPE scaling: original_max_position_embeddings.
    rope_original_max_position: Annotated[int, _AT_LEAST_1] = 8192
    # Longest sequence the model is meant for (HF max_position_embeddings).
    max_position_embeddings: Annotated[int, _AT_LEAST_1] = 2048
    # Share the embedding matrix with the output head (Llama 3.2 1B/3B).
    tie_embeddings: bool = False
    # Standard deviation of the normal initialization of the weights.
    init_std: Annotated[float, _POSITIVE] = 0.02

    # Architecture family, the HF class it loads from and exports to.
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"] = "llama"
    # Size of one attention head (HF head_dim); 0: dim // n_heads.
    attn_head_dim: Annotated[int, Range(0, note="0: dim // n_heads")] = 0
    # Biases on the q, k and v projections (Qwen2 / 2.5).
    qkv_bias: bool = False
    # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Norms scale by (1 + weight), weights start at 0 (Gemma).
    norm_plus_one: bool = False
    # Norms also after attention and after the MLP, before the residual add (Gemma 3).
    sandwich_norms: bool = False
    # The MLP's gate activation: silu (Llama, Qwen, Mistral) or gelu_tanh (Gemma).
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    # Multiply the token embeddings by sqrt(dim) (Gemma).
    scale_embeddings: bool = False
    # Attention scores are scaled by 1/sqrt of this (HF query_pre_attn_scalar); 0: head_dim.
    attn_scale_base: Annotated[float, Range(0, note="0: head_dim")] = 0.0
    # Keys a query sees on sliding-window layers, itself included; 0: no sliding window.
    sliding_window: Annotated[int, Range(0, note="0: none")] = 0
    # One letter per layer, F full attention or S sliding window (HF layer_types); "" with a
    # sliding_window: every layer slides (Mistral); "" without: every layer is full.
    layer_types: str = ""
    # RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq); 0: rope_theta.
    rope_local_theta: Annotated[float, Range(0, note="0: rope_theta")] = 0.0
    # How rope_scaling_factor scales the (global layers') frequencies: llama3 or linear.
    rope_scaling_type: Literal["llama3", "linear"] = "llama3"

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    def layer_window(self, layer: int) -> int:
        """Keys a query of `layer` may see counting itself (0: all earlier ones)."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "S" else 0

    def layer_rope_theta(self, layer: int) -> float:
        """RoPE base of `layer`: sliding layers may have their own (Gemma 3)."""
        if self.layer_window(layer) and self.rope_local_theta:
            return self.rope_local_theta
        return self.rope_theta

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += hd * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + (4 if self.sandwich_norms else 2) * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else emb
        return self.n_layers * block + emb + head + self.dim


def interleaved_layer_types(n_layers: int, every: int) -> str:
    """`ModelConfig.layer_types` with every `every`-th layer full attention and the others
    sliding (Gemma 3's `sliding_window_pattern`: 5 sliding layers to 1 global for 6)."""
    return "".join("S" if (i + 1) % every else "F" for i in range(n_layers))


@dataclass
class ParallelConfig:
    """Mesh sizes. -1 for dp_shard means: whatever the world size leaves after the others."""

    # HSDP: replicas of the FSDP-sharded model (usually the number of nodes).
    dp_replicate: Annotated[int, _AT_LEAST_1] = 1
    # FSDP shards; -1: world size / (dp_replicate x tp).
    dp_shard: Annotated[int, Range(1, also=(-1,), note="-1: what the world size leaves")] = -1
    # Tensor-parallel ranks (innermost mesh axis, keep it inside a node).
    tp: Annotated[int, _AT_LEAST_1] = 1
    # FSDP2 reshard_after_forward for blocks (the root is never resharded after forward).
    reshard_after_forward: bool = True
    # FSDP2 explicit prefetch: all-gather this many blocks ahead (0: FSDP2's implicit default).
    fsdp_prefetch: Annotated[int, _NON_NEGATIVE] = 0
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
    timeout_s: Annotated[int, Range(1, 10**9)] = 600
    # manual: mesh, checkpointing and micro batch as set; auto: the planner's best plan for the
    # launched world size (the start line says which it took; tools/plan.py shows the ranking).
    plan: Literal["manual", "auto"] = "manual"
    # The planner's hardware profile (start-of-run prediction and plan=auto): a preset (h100,
    # h200, a100-80gb, b200, cpu), a JSON file from tools/plan.py --calibrate, or "" for this
    # machine's (its CUDA device's preset, else an uncalibrated CPU guess).
    plan_hardware: str = ""
    # Refuse to start (before data and model are built) when the planned peak per rank exceeds
    # the memory a rank has here: the CUDA device's, or on CPU the host's RAM over its ranks.
    check_memory: bool = True


@dataclass
class TrainConfig:
    """Optimization: steps, batch, learning rate schedule, optimizer."""

    # Optimizer steps to train for.
    steps: Annotated[int, _AT_LEAST_1] = 200
    # Sequences per step over all data-parallel ranks.
    global_batch: Annotated[int, _AT_LEAST_1] = 8
    # 0: the whole per-dp-rank batch at once (no accumulation).
    micro_batch: Annotated[int, Range(0, note="0: no accumulation")] = 0
    # Tokens per sequence.
    seq_len: Annotated[int, _AT_LEAST_1] = 256
    # Peak learning rate (after warmup).
    lr: Annotated[float, _POSITIVE] = 3e-3
    # Learning rate at the last step, as a fraction of lr (cosine decay).
    min_lr_ratio: Annotated[float, _FRACTION] = 0.1
    # Steps of linear warmup from 0 to lr.
    warmup_steps: Annotated[int, _NON_NEGATIVE] = 20
    # AdamW weight decay on matrices (norm weights are not decayed).
    weight_decay: Annotated[float, _NON_NEGATIVE] = 0.1
    # AdamW beta1.
    beta1: Annotated[float, _BETA] = 0.9
    # AdamW beta2.
    beta2: Annotated[float, _BETA] = 0.95
    # 0 disables clipping (the norm is still measured).
    grad_clip: Annotated[float, Range(0, note="0: no clipping")] = 1.0
    optimizer: Literal["adamw", "sgd"] = "adamw"  # adamw | sgd
    # A non-finite loss or grad norm: "stop" the run before the update, or "skip" the update.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # Seed of the weight initialization and of the data order.
    seed: Annotated[int, Range(0, 2**63, hi_open=True)] = 0
    # Validation loss every N steps (and after the last step) when there is validation data
    # (data.val_path or data.val_fraction); 0: only after the last step.
    eval_every: Annotated[int, Range(0, note="0: only after the last step")] = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    """Training text and tokenizer."""

    # A .txt/.jsonl/.parquet file or a directory of them; "" means the built-in corpus
    # (the Python standard library's sources, present wherever Python is); or the shards
    # tools/tokenize_corpus.py wrote (a directory with token-index.json), read memory-mapped;
    # or, with the datasets package, a save_to_disk directory, hf:NAME[:CONFIG][@SPLIT][#REV]
    # (a Hub dataset) or hf:/DIR (local data files), read with load_dataset(streaming=True).
    path: str = ""
    # Several text sources trained on together, each sample drawn by weight:
    # name=path:weight,... (web=/data/web-tok:0.7,code=/data/code-tok:0.3); each path is what
    # data.path takes for text. "" (default): data.path alone. Set, data.path stays "".
    mixture: str = ""
    # Text data.path (or data.mixture's text sources) tokenized on the fly instead of cached
    # first: every rank's background thread tokenizes its share of the documents; the windows
    # are served in the order of data.shuffle_block, as the cached paths serve them
    # (data.shuffle_block 0 is refused).
    streaming: bool = False
    # Text windows of an epoch are shuffled within consecutive blocks of this many windows (the
    # last holds the rest), the same order inline, preprocessed and streamed; streaming holds
    # one block (shuffle_block x train.seq_len tokens per rank) and reads it before the first
    # step. 0: the whole epoch as one block (not streaming). Instruction data is always
    # shuffled over the whole epoch.
    shuffle_block: Annotated[int, Range(0, note="0: the whole epoch as one block")] = 8192
    # The field holding the text in .jsonl and .parquet files.
    text_field: str = "text"
    # tokenizer.json or a HF model directory; "" trains a byte-level BPE of the model's vocab
    # size on the corpus and caches it.
    tokenizer: str = ""
    cache_dir: str = ""  # "" -> ~/.cache/hybrid2d
    # Characters of the built-in corpus to use (0: all of it). Keeps the CPU default quick.
    max_chars: Annotated[int, Range(0, note="0: all of it")] = 4_000_000
    # auto: .jsonl files whose first line has prompt/completion or messages are instruction
    # data (one sample per line, loss on the completion / assistant turns), anything else
    # text; text | instruct force one.
    format: Literal["auto", "text", "instruct"] = "auto"
    # Instruction data only: packed places several samples in a row of train.seq_len (first-fit
    # decreasing, each sample its own attention block and RoPE positions; same loss and
    # gradients as padded); padded gives each sample a row of its own.
    packing: Literal["packed", "padded"] = "packed"
    # Text data only: on confines attention to each document of a window (documents end at
    # EOS) and restarts RoPE positions at each; off lets windows attend across documents.
    document_mask: Literal["off", "on"] = "off"
    # Held-out data for validation, in data.path's formats ("": none, or data.val_fraction).
    val_path: str = ""
    # Fraction of data.path's samples held out for validation when data.val_path is "" (0: none).
    val_fraction: Annotated[float, Range(0, 0.5, hi_open=True, note="0: no held-out part")] = 0.0


@dataclass
class MetricsConfig:
    """Run directory and what is logged."""

    # Where the run writes config.json, summary.json, TensorBoard events and checkpoints;
    # {recipe} and {time} are filled in.
    run_dir: str = "runs/{recipe}-{time}"
    # Log every N steps (the last step is always logged).
    log_every: Annotated[int, _AT_LEAST_1] = 1
    # Write TensorBoard events under the run directory.
    tensorboard: bool = True
    # Show progress on rank 0: a bar on a terminal; where stderr is not one (a log file), a
    # line per logged step (loss, lr, grad norm, tokens/s).
    progress_bar: bool = True
    # Per-rank step breakdown (compute, waiting in collectives, data, optimizer, checkpoint),
    # load balance over the mesh and stragglers, gathered on logged steps into balance.jsonl,
    # TensorBoard and the summary. Off: no timing and no gather (to measure what it costs).
    balance: bool = True
    # A rank is a straggler when its compute per step stays more than this fraction above the
    # median rank's over straggler_window steps (0.2: 20% slower).
    straggler_margin: Annotated[float, _POSITIVE] = 0.2
    # Steps a rank must stay above the margin before it is named (judged on logged steps, so
    # at least one log_every interval).
    straggler_window: Annotated[int, _AT_LEAST_1] = 10


@dataclass
class CheckpointConfig:
    """Saving, resuming and initializing from checkpoints."""

    # Save every N steps; 0: only at the end (when enabled).
    every: Annotated[int, Range(0, note="0: only at the end")] = 0
    # Save a checkpoint after the last step (on by default: every finished run can be
    # generated from, exported and resumed).
    save_final: bool = True
    # Keep the newest N checkpoints of the run, delete older ones.
    keep_last: Annotated[int, _AT_LEAST_1] = 3
    # Write checkpoints from a background thread while training goes on.
    async_save: bool = False
    resume: str = ""  # "" (none) | auto | path of a step directory (or of a run directory)
    # Save a checkpoint after this step and stop (a job's time slot ends); 0: run to train.steps.
    stop_after: Annotated[int, Range(0, note="0: off")] = 0
    init_from: str = ""  # "" | hf:PATH | dcp:PATH


@dataclass
class ProfileConfig:
    """Memory profiling and torch.profiler traces."""

    # Per step and rank memory by category (parameters, gradients, optimizer, activations,
    # communication); memory/* in TensorBoard and a report at the end.
    memory: bool = False
    # CUDA: dump the allocator's snapshot for https://pytorch.org/memory_viz.
    snapshot: bool = False
    # Steps A-B (e.g. 3-4) traced with torch.profiler on every rank: RUN/traces/rank*.json for
    # Perfetto / TensorBoard and a per-rank table (compute, communication, overlap, idle) at the
    # end; "": no traces.
    trace_steps: str = ""

    def trace_range(self) -> tuple[int, int] | None:
        """(A, B) of trace_steps, checked: one line saying what is wrong; None when off."""
        text = self.trace_steps.strip()
        if not text:
            return None
        steps = re.fullmatch(r"([0-9]+) *- *([0-9]+)", text)
        if steps and 1 <= int(steps[1]) <= int(steps[2]):
            return int(steps[1]), int(steps[2])
        raise ConfigError(
            f"profile.trace_steps={self.trace_steps!r} is not a step range A-B with "
            '1 <= A <= B; use e.g. 3-4 (steps 3 and 4), 5-5 (step 5 alone) or "" (no traces)'
        )


# The linear layers of a block an adapter may target (HF's names); `all-linear` means all of
# them (as PEFT's "all-linear": every linear layer but the output head).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on a frozen base; rank 0 trains every weight instead."""

    # Rank of the adapters; 0: full fine-tuning (no adapters, every weight trained).
    rank: Annotated[int, Range(0, note="0: full fine-tuning")] = 0
    # The adapter's output is scaled by alpha / rank (PEFT's lora_alpha).
    alpha: Annotated[float, _POSITIVE] = 16.0
    # Dropout on the adapter's input (PEFT's lora_dropout); 0: none.
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    # Comma-separated linear layers of each block to adapt (q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj), or all-linear for all of them.
    targets: str = "all-linear"
    # dtype of the frozen base weights (the adapters are always fp32): bf16 halves their
    # memory; fp32 keeps the base exact.
    base_dtype: Literal["fp32", "bf16"] = "fp32"
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start the
    # adapters from, on the base checkpoint.init_from names; "": PEFT's initial values.
    init_from: str = ""

    def target_names(self) -> tuple[str, ...]:
        """The targeted layer names, checked: one line naming a target that matches none."""
        if self.targets.strip() == "all-linear":
            return LORA_TARGETS
        names = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        for name in names:
            if name not in LORA_TARGETS:
                close = difflib.get_close_matches(name, LORA_TARGETS, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"lora.targets={self.targets!r}: {name!r} matches no layer of a block{hint}; "
                    f"use all-linear or names from {', '.join(LORA_TARGETS)}"
                )
        if not names:
            raise ConfigError(
                f"lora.targets={self.targets!r} names no layer; use all-linear or names from "
                f"{', '.join(LORA_TARGETS)}"
            )
        return tuple(dict.fromkeys(names))


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
    lora: LoraConfig = field(default_factory=LoraConfig)

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
        hints = type_hints(cls)
        for section, values in d.items():
            if section not in hints:
                raise ConfigError(
                    f"unknown section {section!r} in a saved config; {_suggest(section, hints)}"
                )
            current = getattr(cfg, section)
            if not dataclasses.is_dataclass(current):
                setattr(cfg, section, _typed(section, hints[section], values))
                continue
            if not isinstance(values, dict):
                raise ConfigError(
                    f"section {section!r} of a saved config is {type(values).__name__} "
                    f"{values!r}; expected a mapping of its settings"
                )
            kinds = type_hints(type(current))
            for k, v in values.items():
                key = f"{section}.{k}"
                if k in kinds:
                    setattr(current, k, _typed(key, kinds[k], v))
                elif key not in RETIRED_KEYS:  # those are an older config's settings: dropped
                    raise ConfigError(
                        f"unknown setting {key!r} in a saved config; "
                        f"{_suggest(key, setting_names(cfg))}"
                    )
        return cfg

    # ---- validation -------------------------------------------------------------------------

    def check_settings(self) -> None:
        """Every setting on its own: its type, its choices, and its range (finite numbers)."""
        for name, (owner, f) in leaf_fields(self).items():
            value = _typed(name, type_hints(type(owner))[f.name], getattr(owner, f.name))
            check_range(name, value)
        m = self.model
        if m.rope_scaling_factor > 0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be larger than "
                f"model.rope_low_freq_factor={m.rope_low_freq_factor} when "
                f"model.rope_scaling_factor={m.rope_scaling_factor} (llama3 uses 4 and 1)"
            )
        if m.layer_types and (len(m.layer_types) != m.n_layers or set(m.layer_types) - {"F", "S"}):
            raise ConfigError(
                f"model.layer_types={m.layer_types!r} must be one letter per layer "
                f"(model.n_layers={m.n_layers}), F (full attention) or S (sliding window)"
            )
        if self.lora.rank:
            self.lora.target_names()
        elif self.lora.init_from:
            raise ConfigError(
                f"lora.init_from={self.lora.init_from!r} needs adapters: set lora.rank to the "
                "adapter's rank (its adapter_config.json's r)"
            )
        if self.data.streaming and self.data.shuffle_block == 0:
            raise ConfigError(
                "data.shuffle_block=0 (the whole epoch as one block) cannot be streamed: a stream "
                "holds one block of windows, not the corpus; set data.shuffle_block to a number "
                "of windows (default 8192), or leave data.streaming at false"
            )
        traced = self.profile.trace_range()
        if traced and traced[1] > self.train.steps:
            raise ConfigError(
                f"profile.trace_steps={self.profile.trace_steps!r} ends after the last step "
                f"(train.steps={self.train.steps}); trace steps up to {self.train.steps}"
            )
        if "S" in m.layer_types and not m.sliding_window:
            raise ConfigError(
                f"model.layer_types={m.layer_types!r} has sliding layers but "
                "model.sliding_window=0; set the window size or use only F"
            )


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


def check_range(name: str, value) -> None:
    """A ConfigError unless the value of setting `name` is in its range (numbers only)."""
    limit = LIMITS.get(name)
    if limit is None or value in limit:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value} is not a finite number; use a value {limit}")
    raise ConfigError(f"{name}={value} is out of range; use a value {limit}")


def _typed(name: str, kind, value):
    """`value` (from Python or JSON) as a value of `kind`, or a ConfigError naming `name`."""
    if kind is float and type(value) is int:
        return float(value)
    choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
    if value in choices if choices else type(value) is kind:
        return value
    words = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    what = "one of " + ", ".join(map(repr, choices)) if choices else words[kind]
    raise ConfigError(f"{name}={value!r} is not {what}")


# ---- settings by name ------------------------------------------------------------------------


def leaf_fields(cfg: JobConfig) -> dict[str, tuple[object, dataclasses.Field]]:
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
    return list(leaf_fields(cfg or JobConfig()))


@functools.cache
def type_hints(cls: type, extras: bool = False) -> dict:
    """`typing.get_type_hints` of a settings class, evaluated once: the annotations are strings
    (`from __future__ import annotations`), and evaluating them for every field of every
    validation was most of the planner's time."""
    return typing.get_type_hints(cls, include_extras=extras)


def _range(owner, name: str) -> Range | None:
    hint = type_hints(type(owner), True)[name]
    return next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)), None)


# 'section.field' -> the Range in its annotation (a test checks that every number has one).
LIMITS = {
    n: r for n, (owner, f) in leaf_fields(JobConfig()).items() if (r := _range(owner, f.name))
}


def closest(key: str, names) -> str | None:
    """The valid (dotted) name closest to `key`: the same field in another section (--lr ->
    train.lr), else the most similar full name, else the most similar field name."""
    names = list(names)
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


def _suggest(key: str, names) -> str:
    close = closest(key, names)
    return f"the closest valid one is {close!r}" if close else "none is valid here"
