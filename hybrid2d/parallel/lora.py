"""LoRA: low-rank adapters on a frozen base, applied from outside like the TP plan.

`apply_lora` runs after `apply_tp` and before FSDP. Each targeted linear layer gets two
`nn.Linear` children, `lora_A` [rank, in] and `lora_B` [out, rank] (so their names are PEFT's:
`...q_proj.lora_A.weight`), and its class gains a forward that adds
`lora_B(lora_A(dropout(x))) * alpha / rank` to the base output, the adapter computed in the
adapter's dtype (fp32) and cast to the base output's, as PEFT does. Every other parameter is
frozen (and cast to `lora.base_dtype`).

The adapters follow the layer's tensor-parallel style, read from its weight's placement, so
they cost no activation collective:

- column-parallel (weight sharded on the output features): A replicated, B sharded with the
  output features. Each rank's A gradient is a partial sum (its B shard).
- row-parallel (weight sharded on the input features): A sharded with the input features, B
  replicated. x @ A_local^T is a partial sum of the rank-r activation; B maps it to a partial
  sum of the output, added to the base's partial sum before the style's one reduce-scatter.
  B's gradient is a partial sum, like A's above.
- past the kv heads (k/v weight whole on every rank, each rank computing the rows of its
  query heads' kv head, `module.kv_rows`; tensor_parallel.KVHeadLinear): A and B replicated,
  the adapter's output B[kv_rows] A x. Both gradients are partial sums: A's from this rank's
  rows, B's filling only its kv rows, the ranks sharing a head each adding their queries' part.

FSDP2 then shards adapters and frozen base alike over dp; frozen parameters get no gradient, no
reduce-scatter and (optim.py builds over trainable parameters) no optimizer state.

The partial sums of the replicated adapters' gradients are summed over tp once per step, in
one all-reduce of all of them (`sum_replicated_grads`, after backward) instead of one per
tensor as it reaches its weight: their forward hands DTensor the local gradient as if it were
already summed (`grad_placements=[Replicate()]`), FSDP2 reduce-scatters it over dp as it
does every gradient, and the sum over tp of those dp shards (both sums are linear, so their
order does not matter) is one collective of 1/dp of the bytes. Until then a replicated adapter's
`.grad` holds this rank's partial sum: nothing may read it between backward and that call.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hybrid2d.config import LoraConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import Llama, copy_full_into
from hybrid2d.parallel.activation_checkpoint import mark_output_not_kept
from hybrid2d.parallel.sequence_comm import reduce_scatter_sequence

ADAPTERS = ("lora_A", "lora_B")
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`model.layers.0.self_attn.q_proj.lora_A.weight`) is an
    adapter's: what checkpoints and the optimizer keep, and what a base checkpoint lacks."""
    return any(f".{a}." in f".{name}" for a in ADAPTERS)


def target_layers(model: nn.Module, lcfg: LoraConfig) -> dict[str, nn.Linear]:
    """Path -> the block's linear layer each target names (checked: one line for a target that
    matches no module, or a rank larger than a targeted layer)."""
    names = lcfg.target_names()
    found = {
        path: m
        for path, m in model.named_modules()
        if path.rsplit(".", 1)[-1] in names and isinstance(m, nn.Linear) and ".layers." in path
    }
    for name in names:
        if not any(p.endswith(f".{name}") for p in found):
            raise ConfigError(
                f"lora.targets={lcfg.targets!r}: {name!r} matches no module of this model"
            )
    path, m = min(found.items(), key=lambda pm: min(pm[1].in_features, pm[1].out_features))
    if lcfg.rank > min(m.in_features, m.out_features):
        raise ConfigError(
            f"lora.rank={lcfg.rank} is larger than {path} ({m.in_features} -> "
            f"{m.out_features}); use a rank <= {min(m.in_features, m.out_features)}"
        )
    return found


def apply_lora(model: nn.Module, lcfg: LoraConfig, tp_mesh: DeviceMesh | None = None) -> None:
    """Freeze the (meta or real) model, cast its parameters to `lora.base_dtype` and add fp32
    adapters to the targeted layers, after `apply_tp`, before FSDP. rank 0: no-op."""
    if not lcfg.rank:
        return
    layers = target_layers(model, lcfg)
    _freeze_base(model, BASE_DTYPES[lcfg.base_dtype])
    for path, layer in layers.items():
        _add_adapter(path, layer, lcfg)


def _freeze_base(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(param.detach().to(dtype), False))
    model.tie_weights()  # the embedding and head were re-registered apart


def _add_adapter(path: str, layer: nn.Linear, lcfg: LoraConfig) -> None:
    device = layer.weight.device
    layer.lora_A = nn.Linear(layer.in_features, lcfg.rank, bias=False, device=device)
    layer.lora_B = nn.Linear(lcfg.rank, layer.out_features, bias=False, device=device)
    layer.lora_scale = lcfg.alpha / lcfg.rank
    layer.lora_dropout = lcfg.dropout
    weight = layer.weight
    if not isinstance(weight, DTensor):
        layer.__class__ = _lora_class(_LoraForward, type(layer))
        return
    shard = weight.placements[-1]
    if shard == Shard(0):  # column-parallel
        a, b, forward = Replicate(), Shard(0), _ColumnLoraForward
    elif shard == Shard(1):  # row-parallel
        a, b, forward = Shard(1), Replicate(), _RowLoraForward
    elif shard == Replicate() and hasattr(layer, "kv_rows"):  # past the kv heads
        a, b, forward = Replicate(), Replicate(), _KVHeadLoraForward
    else:
        raise ConfigError(
            f"lora.targets={lcfg.targets!r}: {path} is placed {weight.placements} over tp, "
            "and LoRA follows only column-parallel, row-parallel and kv-head layers; "
            "leave it out of lora.targets"
        )
    _distribute(layer.lora_A, weight.device_mesh, a)
    _distribute(layer.lora_B, weight.device_mesh, b)
    layer.__class__ = _lora_class(forward, type(layer))


def _distribute(linear: nn.Linear, mesh: DeviceMesh, placement) -> None:
    """Make a linear layer's weight a DTensor; each rank slices its piece, no collective."""
    dt = distribute_tensor(linear.weight.detach(), mesh, [placement], src_data_rank=None)
    linear.weight = nn.Parameter(dt)


_CLASSES: dict[tuple[type, type], type] = {}


def _lora_class(forward_cls: type, module_cls: type) -> type:
    """`module_cls` with `forward_cls`'s forward, one class per pair (stable types for compile
    and pickling), as the TP styles do."""
    key = (forward_cls, module_cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{forward_cls.__name__}[{module_cls.__name__}]", key, {})
    return _CLASSES[key]


def _low_rank_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's input: x in the adapter's dtype, with dropout while training."""
    x = x.to(layer.lora_A.weight.dtype)
    return F.dropout(x, layer.lora_dropout, layer.training) if layer.lora_dropout else x


class _LoraForward:
    """Plain layer (tp = 1): base + B A x * scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        low = F.linear(_low_rank_input(self, x), self.lora_A.weight)
        return out + (F.linear(low, self.lora_B.weight) * self.lora_scale).to(out.dtype)


def _partial_grad(weight: DTensor) -> torch.Tensor:
    """The local value of a tp-replicated weight whose gradient each rank only has a partial
    sum of: the gradient is left unsummed (marked replicated, so DTensor issues no collective),
    for `sum_replicated_grads` to sum with all the others in one all-reduce."""
    return weight.to_local(grad_placements=[Replicate()] * weight.device_mesh.ndim)


def replicated_adapters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter weights replicated over tp (column-parallel A, row-parallel B, both past
    the kv heads), whose
    gradients `sum_replicated_grads` sums; [] without tp."""
    out = []
    for name, p in model.named_parameters():
        if is_adapter(name) and isinstance(p, DTensor):
            mesh = p.device_mesh
            if mesh.size(mesh.ndim - 1) > 1 and p.placements[-1] == Replicate():
                out.append(p)
    return out


@torch.no_grad()
def sum_replicated_grads(params: list[nn.Parameter], tp_mesh: DeviceMesh) -> None:
    """Sum the replicated adapters' gradients over tp: one all-reduce of one flat buffer per
    dtype (their dp shards, after FSDP2's reduce-scatter), issued by DTensor as a partial sum
    made replicated, as every other tp reduction. Called once per step after the last
    backward, before anything reads the gradients (clipping, the optimizer)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local()
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        partial = DTensor.from_local(flat, tp_mesh, [Partial()], run_check=False)
        flat = partial.redistribute(tp_mesh, [Replicate()]).to_local()
        for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(summed.view_as(grad))


class _ColumnLoraForward:
    """Column-parallel layer: this rank's output features of base + B A x; A replicated, B and
    the base sharded on the output features. No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        low = F.linear(_low_rank_input(self, x), _partial_grad(self.lora_A.weight))
        delta = F.linear(low, self.lora_B.weight.to_local()) * self.lora_scale
        return out + delta.to(out.dtype)


class _RowLoraForward:
    """Row-parallel layer: the partial sums of base and adapter (A sharded on the input
    features, B replicated) added, then the style's one reduce-scatter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        partial = F.linear(mark_output_not_kept(x), weight.to_local())
        low = F.linear(_low_rank_input(self, x), self.lora_A.weight.to_local())
        delta = F.linear(low, _partial_grad(self.lora_B.weight)) * self.lora_scale
        group = weight.device_mesh.get_group(weight.device_mesh.ndim - 1)
        return reduce_scatter_sequence(partial + delta.to(partial.dtype), group)


class _KVHeadLoraForward:
    """k/v past the kv heads: this rank's kv rows of base + B A x, A and B replicated, both
    gradients partial (summed by `sum_replicated_grads`). No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        start, rows = self.kv_rows
        low = F.linear(_low_rank_input(self, x), _partial_grad(self.lora_A.weight))
        b = _partial_grad(self.lora_B.weight).narrow(0, start, rows)
        return out + (F.linear(low, b) * self.lora_scale).to(out.dtype)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initial adapters, the same whatever the mesh: A uniform in +-1/sqrt(in) (PEFT's
    kaiming_uniform_(a=sqrt(5))) drawn from (seed, name), B zero, so training starts at the
    base model."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        shape = tuple(param.shape)
        if ".lora_A." in name:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(shape[1])
            full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            full = torch.zeros(shape)
        copy_full_into(param, full)


def adapter_state(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters by name (what a LoRA checkpoint saves and the optimizer trains)."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


def adapter_shapes(model: ModelConfig, lcfg: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Full shape of every adapter of this model and these settings (what a LoRA training
    checkpoint's model entry holds); no memory."""
    with torch.device("meta"):
        llama = Llama(model)
    apply_lora(llama, lcfg)
    return {n: tuple(p.shape) for n, p in adapter_state(llama).items()}


def describe_lora(model: nn.Module, lcfg: LoraConfig) -> str:
    """The start line of a LoRA run: what is trained and what stays frozen."""
    params = dict(model.named_parameters())  # numel: the global size, also of DTensors
    trained = sum(p.numel() for n, p in params.items() if is_adapter(n))
    total = sum(p.numel() for p in params.values())
    return (
        f"lora: rank {lcfg.rank}, alpha {lcfg.alpha:g}, dropout {lcfg.dropout:g} on "
        f"{','.join(lcfg.target_names())}; {trained:,} adapter parameters trained "
        f"({100 * trained / total:.2f}% of {total:,}), the base frozen in {lcfg.base_dtype}"
    )
