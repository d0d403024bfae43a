"""Measured memory of one rank: which tensors are alive, by category, and their peak in a step.

`MemoryTracker` is a `TorchDispatchMode` that sees every tensor an op creates (DTensor ops are let
through first, so it sees the local shards they produce) and follows each storage until it is
freed (a weak reference) or resized (FSDP2 frees its gathered parameters with
`UntypedStorage.resize_(0)`, which no dispatch mode sees, so that method is wrapped while the
tracker is active). This is exact on CPU, where every tensor is a separate `malloc`, and is the
per-category view on CUDA, where the caching allocator's own figures give the total.

Categories, each a sum of storage bytes (one storage counted once however many views share it):

- parameters:    this rank's parameter shards, FSDP2's padding included, and module buffers
- gradients:     sharded gradients (FSDP2 stores each unit's as views of one padded buffer)
- optimizer:     optimizer state (AdamW's two moments and its step counters)
- communication: FSDP2's gathered (unsharded) parameters and their gradients before the
                 reduce-scatter, and the flat all-gather / reduce-scatter buffers
- activations:   everything else made in forward/backward: tensors saved for backward,
                 activation gradients, temporaries, the loss and its inputs

`StepMemory` is what one step reports; `static_bytes` counts parameters, gradients and
optimizer state directly from the tensors, independently of the tracker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Private module, no public home yet (torch 2.13): TorchDispatchMode is what FlopCounterMode and
# CommDebugMode are built on; move when torch exports it publicly.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hybrid2d.metrics import device_peaks, peak_rss_bytes, rss_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "communication", "activations")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a plain tensor or a wrapper subclass (DTensor, AsyncCollectiveTensor).

    A wrapper subclass owns no memory itself; its inner tensors do.
    """
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            todo.extend(getattr(x, n) for n in names if isinstance(getattr(x, n), torch.Tensor))
        elif x.device.type != "meta" and hasattr(x, "untyped_storage"):
            out.append(x.untyped_storage())
    return out


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        for st in _storages(t):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def static_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, list[torch.Tensor]]:
    """Parameters (+ buffers), gradients and optimizer state of this rank, by category."""
    params = list(model.parameters())
    state = optimizer.state.values() if optimizer is not None else []
    return {
        "parameters": [*params, *model.buffers()],
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer": [v for s in state for v in s.values() if torch.is_tensor(v)],
    }


def static_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """`static_tensors` in bytes, from the tensors (independently of the tracker)."""
    return {k: storage_bytes(v) for k, v in static_tensors(model, optimizer).items()}


# FSDP2 ops whose tensor arguments are communication buffers (see module docstring).
_COMM_OP_NAMES = ("split_with_sizes_copy", "all_gather_copy_in", "_chunk_cat")


def _is_collective(func) -> bool:
    return getattr(func, "namespace", None) == "c10d"


def _fsdp_params(module: nn.Module) -> list:
    """FSDP2's per-parameter state of one `fully_shard` unit (private API; [] if it moved)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        return list(group.fsdp_params) if group is not None else []
    except AttributeError:
        return []


@dataclass
class _Storage:
    nbytes: int
    category: str
    ref: weakref.ref


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes per category while active, with the step's peaks.

    Use one tracker per step: `with MemoryTracker(model, optimizer) as t: train_step(...)`, then
    read `t.peak`, `t.peak_breakdown`, `t.peak_phase` and `t.max_by_category`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.device: torch.device | None = None
        self._live: dict[int, _Storage] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = self.peak = 0
        self.peak_breakdown = dict.fromkeys(CATEGORIES, 0)
        self.max_by_category = dict.fromkeys(CATEGORIES, 0)
        self.phase = self.peak_phase = "forward"
        self._handles: list = []
        self._grad_hooked: set[int] = set()
        self._orig_resize = None

    # ---- bookkeeping ------------------------------------------------------------------------

    def _on_device(self, st: torch.UntypedStorage) -> bool:
        return self.device is None or st.device == self.device

    def _add(self, t: torch.Tensor, category: str, retag: bool = False) -> None:
        for st in _storages(t):
            if not self._on_device(st):
                continue
            key = st._cdata
            rec = self._live.get(key)
            if rec is None:
                nbytes = st.nbytes()
                ref = weakref.ref(st, lambda _r, key=key: self._free(key))
                self._live[key] = _Storage(nbytes, category, ref)
                self._count(category, nbytes)
            else:
                self._recount(rec, st)  # resized by an op (aten.resize_ and friends)
                if retag and rec.category != category:
                    self._count(rec.category, -rec.nbytes)
                    self._count(category, rec.nbytes)
                    rec.category = category

    def _add_tree(self, tree, category: str, retag: bool = False) -> None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, category, retag)

    def _free(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None:
            self._count(rec.category, -rec.nbytes)

    def _resized(self, st: torch.UntypedStorage) -> None:
        rec = self._live.get(st._cdata)
        if rec is None and st.nbytes() and self._on_device(st):
            # Only FSDP2 resizes storages here: it re-allocates a gathered parameter.
            self._add(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st), "communication")
            self._update_peak()
        elif rec is not None and self._recount(rec, st):
            self._update_peak()

    def _recount(self, rec: _Storage, st: torch.UntypedStorage) -> bool:
        """Follow a storage's new size; False if it kept its size."""
        if rec.nbytes == st.nbytes():
            return False
        self._count(rec.category, st.nbytes() - rec.nbytes)
        rec.nbytes = st.nbytes()
        return True

    def _count(self, category: str, delta: int) -> None:
        self.current[category] += delta
        self.total += delta
        if self.current[category] > self.max_by_category[category]:
            self.max_by_category[category] = self.current[category]

    def _update_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.current)
            self.peak_phase = self.phase

    # ---- hooks ------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        # Runs after FSDP's own pre-forward, which has gathered the unit's parameters and swapped
        # them into their modules: what the modules hold now are the unsharded parameters.
        def pre_forward(unit, _args):
            for fsdp_param in _fsdp_params(unit):
                # Gradients kept unsharded between micro batches (their sync deferred); in fp32
                # under mixed precision, where FSDP2 holds them apart from `.grad`.
                acc = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                if acc is not None:
                    self._add(acc, "communication", retag=True)
                info = fsdp_param._module_info
                p = getattr(info.module, info.param_name)
                self._add(p, "communication", retag=True)
                if id(p) not in self._grad_hooked and p.requires_grad:
                    self._grad_hooked.add(id(p))
                    hook = functools.partial(self._tag_grad, "communication")
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                self._handles.append(module.register_forward_pre_hook(pre_forward))
        for p in self.model.parameters():
            if p.requires_grad:
                hook = functools.partial(self._tag_grad, "gradients")
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

        if self.optimizer is not None:
            opt = self.optimizer
            self._handles.append(opt.register_step_pre_hook(lambda *a: self._phase("optimizer")))
            self._handles.append(opt.register_step_post_hook(lambda *a: self._phase("forward")))

    def _phase(self, phase: str) -> None:
        self.phase = phase

    def _tag_grad(self, category: str, p: torch.Tensor) -> None:
        """After a gradient is accumulated: an FSDP unit's unsharded one, or a sharded one."""
        if p.grad is not None:
            self._add(p.grad, category, retag=True)

    # ---- the mode ---------------------------------------------------------------------------

    def __enter__(self):
        params = list(self.model.parameters())
        if params:
            self.device = _local(params[0]).device
        for category, tensors in static_tensors(self.model, self.optimizer).items():
            self._add_tree(tensors, category)
        self.max_by_category = dict(self.current)
        self.peak = self.total
        self.peak_breakdown = dict(self.current)
        self._install_hooks()
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        def resize_(st, size):
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grad_hooked.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run; its local ops come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "").split(".")[0]
        if name in _COMM_OP_NAMES or _is_collective(func):
            if name == "all_gather_copy_in":
                # Its inputs are the parameter shards; its output is the flat buffer.
                buffers = args[1]
            elif _is_collective(func) and "reduce_scatter" in func.__name__:
                # Its output becomes the sharded gradients (tagged by their hook).
                buffers = (args[1:], kwargs)
            else:
                buffers = (args, kwargs)
            self._add_tree(buffers, "communication", retag=True)
        if self.phase != "optimizer":
            # The autograd engine runs a graph task during backward (the loss's included).
            self.phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self._add_tree(out, "optimizer" if self.phase == "optimizer" else "activations")
        self._update_peak()
        return out


@dataclass
class StepMemory:
    """One step's memory on one rank. Bytes throughout."""

    step: int
    rank: int
    parameters: int  # static: this rank's shards (+ buffers), from the tensors
    gradients: int  # static: sharded gradients when the optimizer steps
    optimizer: int  # static: optimizer state after the step
    activations: int  # the activation category's own peak during the step
    communication: int  # the communication category's own peak during the step
    peak: int  # peak of all tracked tensor bytes during the step
    peak_phase: str  # forward | backward | optimizer
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    rss: int = 0  # process resident set size after the step (CPU)
    rss_peak: int = 0  # peak RSS of the process so far
    device_peak: int = 0  # CUDA: torch.cuda.max_memory_allocated during the step
    device_reserved_peak: int = 0  # CUDA: max_memory_reserved during the step

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def measure_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, rank: int = 0
):
    """Track one step; yields a list that holds the step's `StepMemory` afterwards."""

    result: list[StepMemory] = []
    statics: dict[str, int] = {}

    def after_step(*_a):
        statics.update(static_bytes(model, optimizer))

    handle = optimizer.register_step_post_hook(after_step) if optimizer is not None else None
    device = next(iter(model.parameters())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = MemoryTracker(model, optimizer)
    try:
        with tracker:
            yield result
    finally:
        if handle is not None:
            handle.remove()
    if not statics:
        statics = static_bytes(model, optimizer)
    device_peak, device_reserved_peak = device_peaks(device)
    result.append(
        StepMemory(
            step,
            rank,
            **statics,
            activations=tracker.max_by_category["activations"],
            communication=tracker.max_by_category["communication"],
            peak=tracker.peak,
            peak_phase=tracker.peak_phase,
            peak_breakdown=dict(tracker.peak_breakdown),
            rss=rss_bytes(),
            rss_peak=peak_rss_bytes(),
            device_peak=device_peak,
            device_reserved_peak=device_reserved_peak,
        )
    )
