"""How one run is laid out over its ranks: the mesh, the batch split and the model's shape.

The settings say what the user asked for; several sources decide what a launch really does: the
world size, accelerate's `PARALLELISM_CONFIG_*` sizes, the shape of an `init_from` checkpoint and
`parallel.plan auto`. `resolve.py` reads them once and builds a `RunLayout`; from then on the
layout is the only owner of the mesh sizes, dp, the local and micro batch, the number of micro
batches, activation checkpointing and the model's shape, and the settings object is never
changed. Everything that needs one of these numbers (mesh, model, data loader, memory estimate,
planner, simulation) reads it here, so no two rooms can work it out differently.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError

# The mesh's dimensions, outermost first (tp innermost: contiguous ranks, inside a node).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


@dataclass(frozen=True)
class RunLayout:
    """One run's resolved layout (see the module doc). Build it with `RunLayout.build`, which
    checks every rule that needs no process group; the fields are never changed afterwards
    (`model` is a private copy: treat it as read-only)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    global_batch: int  # sequences per optimizer step over all dp ranks
    micro_batch: int  # sequences per forward/backward on one dp rank
    activation_checkpoint: str  # none | full | selective
    model: ModelConfig
    # Where the tokenizer comes from: data.tokenizer, or the init_from checkpoint's own
    # tokenizer.json ("": a BPE trained on data.path).
    tokenizer: str = ""

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def local_batch(self) -> int:
        """Sequences per step on one dp rank (its tp ranks see the same ones)."""
        return self.global_batch // self.dp

    @property
    def n_micro(self) -> int:
        """Forward/backward passes per step (gradient accumulation)."""
        return self.local_batch // self.micro_batch

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return self.dp_replicate, self.dp_shard, self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, shard, tp) of a global rank; tp is fastest, as in `mesh.py`."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is not in [0, {self.world}) for mesh {self}")
        return rank // (self.tp * self.dp_shard), (rank // self.tp) % self.dp_shard, rank % self.tp

    def __str__(self) -> str:
        """The mesh as tools/plan.py and the memory report write it: 4x2, or 2x4x2 with HSDP."""
        rep = f"{self.dp_replicate}x" if self.dp_replicate > 1 else ""
        return f"{rep}{self.dp_shard}x{self.tp}"

    def settings(self) -> dict[str, object]:
        """The layout as the settings that would ask for it ('parallel.tp' -> 2, ...): what a
        run's config.json records, so that a resume or an export sees what really ran."""
        return {
            "parallel.dp_replicate": self.dp_replicate,
            "parallel.dp_shard": self.dp_shard,
            "parallel.tp": self.tp,
            "parallel.activation_checkpoint": self.activation_checkpoint,
            # 0 is the setting's word for the whole per-rank batch, which stays right on a
            # mesh of another dp size (a resume, a memory report of another mesh).
            "train.micro_batch": self.micro_batch if self.n_micro > 1 else 0,
            "data.tokenizer": self.tokenizer,
            **{f"model.{k}": v for k, v in dataclasses.asdict(self.model).items()},
        }

    def recorded(self, cfg: JobConfig) -> dict:
        """cfg.to_dict() with this layout's values in place of the settings' (a new dict)."""
        out = cfg.to_dict()
        for name, value in self.settings().items():
            section, key = name.split(".")
            out[section][key] = value
        return out

    @classmethod
    def build(
        cls,
        cfg: JobConfig,
        world: int,
        *,
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
        tp: int | None = None,
        micro_batch: int | None = None,
        activation_checkpoint: str | None = None,
        model: ModelConfig | None = None,
        tokenizer: str | None = None,
    ) -> RunLayout:
        """cfg laid out on `world` ranks, each keyword (a launcher's size, a plan's choice, a
        checkpoint's model) taking the place of its setting; a ConfigError naming the setting
        and what would work when the pieces do not fit together."""
        cfg.check_settings()
        p, t, m = cfg.parallel, cfg.train, model or cfg.model
        rep = p.dp_replicate if dp_replicate is None else dp_replicate
        tp = p.tp if tp is None else tp
        shard = _dp_shard(world, rep, p.dp_shard if dp_shard is None else dp_shard, tp)
        dp = rep * shard
        _check_model(m, tp, world)
        _check_train(cfg, m, tp, dp)
        local = t.global_batch // dp
        micro = t.micro_batch if micro_batch is None else micro_batch
        if micro and local % micro:
            raise ConfigError(
                f"train.micro_batch={micro} does not divide the per-rank batch {local} "
                f"(global_batch / dp); use one of {divisors(local)} or 0"
            )
        return cls(
            dp_replicate=rep,
            dp_shard=shard,
            tp=tp,
            global_batch=t.global_batch,
            micro_batch=micro or local,
            activation_checkpoint=activation_checkpoint or p.activation_checkpoint,
            model=copy.deepcopy(m),
            tokenizer=cfg.data.tokenizer if tokenizer is None else tokenizer,
        )

    @classmethod
    def on_mesh(cls, cfg: JobConfig, mesh: str | tuple[int, int, int], **choices) -> RunLayout:
        """cfg laid out on a mesh given as (dp_replicate, dp_shard, tp) or as text ('8x8',
        '2x4x8'), the world being its product (a tool's --mesh, a planner's candidate)."""
        sizes = (
            mesh_sizes(mesh) if isinstance(mesh, str) else dict(zip(MESH_DIMS, mesh, strict=True))
        )
        return cls.build(cfg, math.prod(sizes.values()), **sizes, **choices)

    def with_choices(self, cfg: JobConfig, **choices) -> RunLayout:
        """This layout for other settings (a simulation's), some choices changed, checked again."""
        current = {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "micro_batch": self.micro_batch,
            "activation_checkpoint": self.activation_checkpoint,
            "model": self.model,
            "tokenizer": self.tokenizer,
        }
        current.update(choices)
        world = current["dp_replicate"] * current["dp_shard"] * current["tp"]
        return RunLayout.build(cfg, world, **current)


def mesh_sizes(text: str, flag: str = "--mesh") -> dict[str, int]:
    """'DPxTP' (FSDP over DP ranks, TP inside) or 'REPxSHARDxTP' (HSDP) as RunLayout.build's
    keywords."""
    parts = re.split(r"[x,*]", text.strip().lower())
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (2, 3) or min(sizes, default=0) < 1:
        raise ConfigError(
            f"{flag} {text!r} is not DPxTP (e.g. 8x8) or REPLICATExSHARDxTP (e.g. 2x4x8)"
        )
    if len(sizes) == 2:
        sizes = [1, *sizes]
    return dict(zip(MESH_DIMS, sizes, strict=True))


def _dp_shard(world: int, rep: int, shard: int, tp: int) -> int:
    """parallel.dp_shard for this world (-1: what the others leave), or a ConfigError."""
    if shard == -1:
        if world % (rep * tp):
            raise ConfigError(
                f"world size {world} is not divisible by parallel.dp_replicate x "
                f"parallel.tp = {rep} x {tp}; pick tp among {divisors(world)}"
            )
        shard = world // (rep * tp)
    if rep * shard * tp != world:
        raise ConfigError(
            f"world size {world} != parallel.dp_replicate x parallel.dp_shard x "
            f"parallel.tp = {rep} x {shard} x {tp}; set parallel.dp_shard=-1 "
            f"or sizes whose product is {world}"
        )
    return shard


def tp_fits(m: ModelConfig, tp: int) -> bool:
    """Whether tp ranks can split the model: query heads, ffn and vocabulary evenly, and the
    kv heads evenly or, past them, each kv head shared by the same number of ranks."""
    kv = m.n_kv_heads % tp == 0 or tp % m.n_kv_heads == 0
    return kv and all(v % tp == 0 for v in (m.n_heads, m.ffn_dim, m.vocab_size))


def _check_model(m: ModelConfig, tp: int, world: int) -> None:
    """The model's shape on its own and split over tp ranks."""
    if not tp_fits(m, tp):
        split = (
            ("model.n_heads", m.n_heads),
            ("model.ffn_dim", m.ffn_dim),
            ("model.vocab_size", m.vocab_size),
        )
        what = next((f"{k}={v}" for k, v in split if v % tp), None)
        if what is None:
            what = f"model.n_kv_heads={m.n_kv_heads} (nor is it a multiple of it)"
        fits = [d for d in divisors(world) if tp_fits(m, d)]
        raise ConfigError(f"parallel.tp={tp} does not divide {what}; use tp in {fits}")
    if not m.attn_head_dim and m.dim % m.n_heads:
        raise ConfigError(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; "
            "set model.attn_head_dim for heads of another size"
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"model.attn_head_dim or model.dim / model.n_heads gives an odd head size "
            f"{m.head_dim}; RoPE rotates pairs of channels, use an even one"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}"
        )


def _check_train(cfg: JobConfig, m: ModelConfig, tp: int, dp: int) -> None:
    """Sequence, batch, checkpoint and validation settings against the mesh and the model."""
    t, c, d = cfg.train, cfg.checkpoint, cfg.data
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
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is longer than model.max_position_embeddings="
            f"{m.max_position_embeddings}, the positions the model is built for (and its "
            "export says); use a shorter seq_len, or for a new model a larger "
            "model.max_position_embeddings"
        )
    if c.stop_after and c.stop_after >= t.steps:
        raise ConfigError(
            f"checkpoint.stop_after={c.stop_after} is not before the last step "
            f"(train.steps={t.steps}), so it would not stop the run early; use a step below "
            f"{t.steps}, or 0"
        )
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
