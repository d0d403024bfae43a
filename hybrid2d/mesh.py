"""Process group and the (dp_replicate, dp_shard, tp) DeviceMesh.

tp is the innermost axis, so with ranks numbered node by node a tp group is contiguous ranks
inside one node; dp_shard (FSDP) and dp_replicate (HSDP) span nodes. The device and the backend
are chosen here once; the rest of the code takes them from the mesh.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybrid2d import shm_backend
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import world_from_env
from hybrid2d.layout import RunLayout


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible; use cpu or auto")
    return requested


@dataclass
class Mesh:
    """The DeviceMesh of a RunLayout and the sub-meshes each part of the trainer works over.
    The sizes are the layout's (their one owner)."""

    mesh: DeviceMesh
    flat_dp: DeviceMesh
    device: torch.device
    layout: RunLayout

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    def with_layout(self, layout: RunLayout) -> Mesh:
        """This mesh (the same groups) for another layout of the same shape: another model or
        batch split on the ranks of a mesh already built."""
        if layout.mesh_shape != self.layout.mesh_shape:
            raise ValueError(f"layout {layout} does not fit mesh {self.layout}")
        return dataclasses.replace(self, layout=layout)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks (replicate x shard) as one axis: loss and batch sharding."""
        return self.flat_dp

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """1-D for FSDP, 2-D (replicate, shard) for HSDP."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank()


def process_group_backend(device_type: str, shm_collectives: str) -> str:
    """The one place the transport is chosen. CUDA: nccl. CPU: gloo, or with
    parallel.shm_collectives auto/on the shared-memory backend (shm_backend.py), which serves
    the collectives of ranks on one host through shared memory and hands the rest to gloo;
    every group created afterwards (the mesh's included) inherits it."""
    if device_type == "cuda":
        return "nccl"
    if shm_collectives == "off":
        return "gloo"
    shm_backend.register()
    shm_backend.configure(shm_collectives)
    return f"cpu:{shm_backend.BACKEND}"


def init_distributed(device_type: str, timeout_s: int, shm_collectives: str = "auto") -> None:
    """Start the default process group (a one-rank group when not launched by a launcher)."""
    if dist.is_initialized():
        return
    rank, world, local_rank, _ = world_from_env()
    backend = process_group_backend(device_type, shm_collectives)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ and world == 1:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across --max_restarts attempts, and keys the previous
        # attempt wrote (such as gloo's peer addresses) would be read as if current: give each
        # attempt its own key space.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timeout,
        )
        store = dist.PrefixStore(f"hybrid2d/attempt_{attempt}", agent_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


def tp_locality_warning(tp: int) -> str | None:
    """A warning when a tp group would span nodes (tp > processes per node)."""
    _, world, _, local_world = world_from_env()
    if tp > local_world and world > 1:
        return (
            f"parallel.tp={tp} spans nodes (LOCAL_WORLD_SIZE={local_world}): tensor parallelism "
            "communicates in every layer and is slow across nodes; prefer tp <= GPUs per node"
        )
    return None


def group_options(timeout_s: int):
    """Options that give the groups DeviceMesh creates the run's timeout: without them they
    take torch's default (30 min for gloo and shared memory, 10 for nccl), not the default
    group's, and a stopped peer held the others far past parallel.timeout_s. `_timeout` is the
    field torch's own new_group reads; torch has no public options constructor for it."""
    timeout = timedelta(seconds=timeout_s)
    backend = dist.get_backend()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return backend, options
    return backend, torch._C._distributed_c10d.Backend.Options(backend, timeout)


def build_mesh(device_type: str, layout: RunLayout, timeout_s: int | None = None) -> Mesh:
    """The layout's (dp_replicate, dp_shard, tp) mesh; its groups time out after timeout_s
    (None: torch's defaults)."""
    message = tp_locality_warning(layout.tp)
    if message:  # one line from rank 0, not a UserWarning with its source line from every rank
        print0(f"warning: {message}", file=sys.stderr)
    names = ("dp_replicate", "dp_shard", "tp")
    options = None if timeout_s is None else group_options(timeout_s)
    mesh = init_device_mesh(
        device_type,
        layout.mesh_shape,
        mesh_dim_names=names,
        backend_override=None if options is None else dict.fromkeys(names, options),
    )
    flat_dp = mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=options)
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else (torch.device("cpu"))
    )
    return Mesh(mesh, flat_dp, device, layout)


def describe_transport(mesh: Mesh) -> str:
    """What carries each mesh axis's collectives, for the start line: "nccl", "gloo", or
    "shared memory (tp, dp_shard)" and the fallbacks' reasons."""
    backend = dist.get_backend()
    if shm_backend.BACKEND not in backend:
        return backend
    shared, other = [], []
    for name in ("dp_replicate", "dp_shard", "tp"):
        if mesh.mesh[name].size() > 1:
            group = mesh.mesh[name].get_group()
            if shm_backend.uses_shared_memory(group):
                shared.append(name)
            else:
                other.append(f"{name}: {shm_backend.fallback_reason(group)}")
    text = f"shared memory ({', '.join(shared)})" if shared else "gloo"
    return text + (f", gloo for {'; '.join(other)}" if other else "")


def collective_wait_clock() -> Callable[[], float] | None:
    """A clock of the seconds this process has been blocked waiting for peers in collectives,
    where the transport can tell (the shared-memory backend: every collective it serves); None
    where it cannot (gloo, nccl, no process group): there only the waits a caller times
    itself are seen."""
    if not dist.is_initialized() or shm_backend.BACKEND not in dist.get_backend():
        return None
    return shm_backend.waited_seconds if shm_backend.uses_shared_memory() else None


def set_cpu_threads() -> None:
    """Share the cores between the processes of this node unless the user chose a count."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    _, _, _, local_world = world_from_env()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


class CollectiveError(RuntimeError):
    """A collective failed on this rank: it timed out, a peer died, or the ranks disagreed.

    The cause is a peer or the network, not this rank's code, so it is reported as one line
    per rank (each says what it saw) instead of a traceback, with its own exit status.
    """


# gloo's errors start with the C++ source location: "[.../gloo/transport/tcp/pair.cc:534] ..."
_GLOO_LOCATION = re.compile(r"^\[[^\]]*gloo/[^\]]*\]\s*")


def collective_failure(error: BaseException) -> str | None:
    """The one-line reason if `error` is a failed collective (any backend), else None."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    if isinstance(error, dist.DistError):  # nccl, the shared-memory backend, the store
        return first
    if _GLOO_LOCATION.match(text):  # gloo raises plain RuntimeErrors
        advice = first.find(". This is typically")  # gloo's generic advice, not this failure's
        reason = "gloo: " + _GLOO_LOCATION.sub("", first[: advice if advice > 0 else None])
        return reason + _collective_in(error)
    return None


def _collective_frame(error: BaseException):
    """The frame of the failed collective in the error's traceback: the innermost one whose
    `group` is a process group (torch's collectives, FSDP's, this package's sequence_comm: a
    functional collective fails in a `wait_tensor` that knows no group, called from one that
    does), else the innermost public function of torch.distributed; None if neither is there."""
    with_group = public = None
    tb = error.__traceback__
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        group = frame.f_locals.get("group")
        if (
            group is None
            and "group" in frame.f_locals
            and "/torch/distributed/" in (code.co_filename.replace(os.sep, "/"))
        ):
            group = dist.group.WORLD  # torch's `group=None`: the default group
        if isinstance(group, dist.ProcessGroup):
            with_group = frame
        if not code.co_name.startswith("_") and code.co_name != "wrapper":
            if "/torch/distributed/" in code.co_filename.replace(os.sep, "/"):
                public = frame
        tb = tb.tb_next
    return with_group or public


def _group_ranks(frame) -> list[int] | None:
    """The global ranks of the frame's `group` (None: the default group); None if it has
    none or it is no live group."""
    if frame is None or "group" not in frame.f_locals:
        return None
    try:
        return dist.get_process_group_ranks(frame.f_locals["group"] or dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None


def _collective_in(error: BaseException) -> str:
    """' in all_reduce over ranks [0, 1]': the collective a gloo error came from and its group,
    read from its traceback (gloo's message names neither; the shared-memory backend's does);
    '' when the traceback does not show it."""
    frame = _collective_frame(error)
    if frame is None:
        return ""
    ranks = _group_ranks(frame)
    return f" in {frame.f_code.co_name}" + ("" if ranks is None else f" over ranks {ranks}")


PEER_REPORT_S = 3.0  # how long a failed rank waits for its group's other failures to be posted


def _did_not_come(ranks: list[int], me: int, wait_s: float = PEER_REPORT_S) -> list[int] | None:
    """The ranks of the failed collective's group that posted no failure of their own within
    wait_s: on gloo, whose message does not say, the ranks that never came to the collective
    (hung, or gone). Every rank that fails posts a key in the default group's store (torchrun's
    agent's, or rank 0's: its server thread answers even while rank 0 hangs). None when the
    store cannot be reached. `_get_default_store` is private: torch has no public accessor of
    the default group's store (move to one if it gets one)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"hybrid2d/collective_failed/{me}", "1")
        others = [r for r in ranks if r != me]
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in others if not store.check([f"hybrid2d/collective_failed/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is gone too: say nothing of the peers
        return None


def as_collective_error(error: BaseException, timeout_s: int) -> CollectiveError | None:
    """A failed collective (any backend) as this rank's one-line CollectiveError, naming the
    rank and parallel.timeout_s, and on gloo the ranks that did not come; None for any other
    error."""
    reason = collective_failure(error)
    if reason is None:
        return None
    me = world_from_env()[0]
    rank = f"rank {me}"
    ranks = _group_ranks(_collective_frame(error)) if reason.startswith("gloo: ") else None
    absent = None if ranks is None else _did_not_come(ranks, me)
    if absent:
        who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
        reason += f"; {who} did not come (no failure of its own within {PEER_REPORT_S:g} s)"
    where = "" if reason.startswith(rank + ":") else rank + ": "
    return CollectiveError(f"{where}{reason} (parallel.timeout_s={timeout_s})")


def agree(error: str | None, group=None) -> None:
    """Raise ConfigError(first error of any rank) on every rank, or return on every rank.

    Each rank runs its checks without raising, then this one collective makes all ranks fail
    together, so none is left waiting at a later collective for a rank that gave up.
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        errors: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e), None)
    if error:
        raise ConfigError(error)


def agree_on_settings(settings: dict, layout: dict | None = None) -> None:
    """ConfigError on every rank when ranks were launched with different settings (nodes started
    with different command lines or config files), naming the first that differ; where the
    settings agree, when they resolved another `layout` (RunLayout.settings(): the launcher's
    environment or a checkpoint differed). Called before the mesh is built: with another tp on
    one node, the ranks would build different groups and wait on each other with nothing said."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = {f"{section}.{key}": value for section, d in settings.items() if isinstance(d, dict)
            for key, value in d.items()}  # fmt: skip
    seen: list[tuple | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (flat, layout or {}))
    for what, index in (("other settings than rank 0", 0), ("another layout than rank 0", 1)):
        first = seen[0][index]
        for rank, other in enumerate(entry[index] for entry in seen):
            differ = [
                k for k in sorted(first.keys() | other.keys()) if first.get(k) != other.get(k)
            ]
            if differ:
                shown = ", ".join(
                    f"{k}={other.get(k)!r} (rank 0: {first.get(k)!r})" for k in differ[:3]
                )
                more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
                how = "" if index == 0 else " (its launcher environment or files differ)"
                raise ConfigError(
                    f"rank {rank} was launched with {what}: {shown}{more}{how}; "
                    "launch every node with the same command line and config"
                )


def on_rank0(fn):
    """fn() on global rank 0 only; every rank returns its result, or every rank raises the
    ConfigError it raised (the error travels with the broadcast, so nobody waits for a rank 0
    that gave up)."""
    message = [None, None]
    if dist.get_rank() == 0:
        try:
            message[0] = fn()
        except ConfigError as e:
            message[1] = str(e)
    dist.broadcast_object_list(message, src=0)
    if message[1]:
        raise ConfigError(message[1])
    return message[0]


def is_main_process() -> bool:
    return world_from_env()[0] == 0


def print0(*args, file=None) -> None:  # None: sys.stdout at call time
    if is_main_process():
        print(*args, file=file, flush=True)


def shutdown_distributed(wait_for_peers: bool = True) -> None:
    """Barrier, destroy the process groups, and free them before the interpreter exits.

    Without the barrier a rank that tears gloo down while a peer still talks to it makes the
    peer abort (SIGABRT) instead of exiting with its own status. If a peer is gone the barrier
    fails and teardown is left to process exit. wait_for_peers=False skips the barrier: after
    this rank failed alone (a timed-out collective) the peers will not come, and waiting for
    them would hold the failure back for another parallel.timeout_s.
    """
    if not dist.is_initialized():
        return
    try:
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a dead peer: nothing left to synchronise with
        return
    _free_process_groups()


def _free_process_groups() -> None:
    """Let the destroyed groups' destructors run now, joining gloo's worker threads.

    destroy_process_group only forgets the groups: each DeviceMesh keeps them in its
    `_pg_registry`, and DTensor's sharding cache keeps the meshes alive. Gloo's threads then
    run into interpreter exit, and one that frees a finished collective's tensor needs the GIL
    while Python finalizes: the process aborts with "terminate called without an active
    exception" (pytorch#190489), a failed exit after a good run.
    """
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, and torch.distributed's
        # deprecated `reduce_op` object warns on every attribute read.
        if issubclass(type(obj), DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()
