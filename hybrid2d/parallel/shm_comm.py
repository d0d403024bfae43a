"""Collectives through shared memory for ranks of one CPU host (parallel.shm_collectives).

Gloo moves every byte through loopback TCP and two helper threads: on a CPU host a 1 MiB
all-gather costs 1-2 ms of CPU per rank, and the 36 sequence-parallel collectives of a small
model's step cost about as much as its matmuls. Ranks of one host instead exchange through one
shared-memory file per process group: each rank copies its input into its own slot, raises a
flag, and reads the peers' slots once their flags are up. A FIFO per rank carries wake-up bytes,
so a waiting rank sleeps in `select` instead of spinning on a core its peer needs.

Buffer reuse is safe because slots alternate between two generations: a rank can start
generation g+2 (overwriting g's slot) only after every peer posted g+1, which a peer does only
after it finished reading generation g.

Only x86-64 (its stores become visible in program order, so a peer that sees a flag also sees
the data written before it), only gloo on CPU, only when every rank of the group maps the same
file. Anything else, or an input larger than a slot, goes through the process group.

The collectives are torch custom ops, so dispatch modes (CommDebugMode, the comm report) see
them and torch.compile treats them as opaque calls.
"""

from __future__ import annotations

import errno
import os
import platform
import select
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hybrid2d.config import ConfigError

_ALIGN = 64
_FLAG_STRIDE = 8  # int64 flags 64 bytes apart: no two ranks write one cache line
_LIVENESS_S = 0.25  # a wait checks that its peers are alive this often
_TRANSPORTS: dict[str, ShmTransport] = {}


class ShmUnavailable(RuntimeError):
    """Shared memory cannot serve this group (the message says why)."""


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, start: str | None) -> bool:
    """Still the same running process (a reused pid has another start time)."""
    return start is not None and _start_time(pid) == start


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmTransport:
    """Exchange of equal-sized tensors between the ranks of one process group.

    `slot_bytes` bounds one rank's input per collective (`fits`).
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int, timeout_s: float):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_group_rank(group, dist.get_rank())
        self.slot_bytes = _round_up(max(slot_bytes, _ALIGN))
        self.timeout_s = timeout_s
        self.generation = 0
        self.buffer = None
        self.own_fifo = None
        self.peer_fifos: list[int] = []
        self.peers: list[tuple[int, str | None]] = []
        header = _round_up(self.n * _FLAG_STRIDE * 8)
        total = header + 2 * self.n * self.slot_bytes
        name, nonce, error = self._agree_on_file(total)
        path = f"/dev/shm/{name}"
        fifos = [f"/dev/shm/{name}-{r}.fifo" for r in range(self.n)]
        try:
            # A peer's death must end a wait at once (gloo notices a closed socket; here
            # nothing would). Peers are watched through /proc, so they must be visible there.
            ids = [None] * self.n
            dist.all_gather_object(ids, (os.getpid(), _start_time(os.getpid())), group=group)
            self.peers = [ident for r, ident in enumerate(ids) if r != self.rank]
            if error is None:
                error = self._open(path, nonce, total, fifos)
            if error is None and not all(_alive(pid, start) for pid, start in self.peers):
                error = f"rank {dist.get_rank()}: its peers are in another PID namespace"
            errors = [None] * self.n
            dist.all_gather_object(errors, error, group=group)
        finally:
            # Every rank has mapped the file or failed: the names can go, the mappings stay.
            # (Every rank unlinks: a rank with another /dev/shm may have created a stray file.)
            dist.barrier(group=group)
            _unlink(path)
            _unlink(fifos[self.rank])
        failed = [e for e in errors if e]
        if failed:
            self.close()
            raise ShmUnavailable(failed[0])
        self.flags = self.buffer[:header].view(torch.int64)[::_FLAG_STRIDE][: self.n]
        self.data = self.buffer[header:]

    def _agree_on_file(self, total: int) -> list:
        """Group rank 0 creates and sizes the file; every rank learns its name (or the error)."""
        message = [None, None, None]
        if self.rank == 0:
            name, nonce = f"hybrid2d-{uuid.uuid4().hex}", uuid.uuid4().bytes
            message = [name, nonce, None]
            try:
                fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    # Reserve the pages now: a full tmpfs fails here, not with SIGBUS later.
                    os.posix_fallocate(fd, 0, total)
                    os.pwrite(fd, nonce, total - len(nonce))
                finally:
                    os.close(fd)
            except OSError as e:
                _unlink(f"/dev/shm/{name}")
                message[2] = f"cannot create {total / 2**20:.1f} MiB in /dev/shm: {e}"
        dist.broadcast_object_list(
            message, src=dist.get_global_rank(self.group, 0), group=self.group
        )
        return message

    def _open(self, path: str, nonce: bytes, total: int, fifos: list[str]) -> str | None:
        error = None
        try:
            self.buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            if bytes(self.buffer[total - len(nonce) :].tolist()) != nonce:
                error = f"{path} is not the file group rank 0 wrote (another /dev/shm?)"
            else:
                os.mkfifo(fifos[self.rank], 0o600)
                # O_RDWR: the FIFO always has a reader and a writer, so opens never block and a
                # dead peer shows up as a timeout rather than end-of-file.
                self.own_fifo = os.open(fifos[self.rank], os.O_RDWR | os.O_NONBLOCK)
        except (OSError, RuntimeError) as e:
            error = f"rank {dist.get_rank()}: {e}"
        dist.barrier(group=self.group)  # every FIFO exists before anyone opens a peer's
        if error is None:
            try:
                for r in range(self.n):
                    if r != self.rank:
                        self.peer_fifos.append(os.open(fifos[r], os.O_WRONLY | os.O_NONBLOCK))
            except OSError as e:
                error = f"rank {dist.get_rank()}: cannot open a peer's FIFO: {e}"
        return error

    def close(self) -> None:
        for fd in [self.own_fifo, *self.peer_fifos]:
            if fd is not None:
                os.close(fd)
        self.own_fifo, self.peer_fifos, self.buffer = None, [], None

    def fits(self, x: torch.Tensor) -> bool:
        return (
            self.buffer is not None
            and x.device.type == "cpu"
            and x.numel() * x.element_size() <= self.slot_bytes
        )

    # ---- synchronisation -----------------------------------------------------------------

    def _slot(self, generation: int, rank: int, nbytes: int) -> torch.Tensor:
        start = ((generation % 2) * self.n + rank) * self.slot_bytes
        return self.data[start : start + nbytes]

    def _post(self) -> None:
        self.flags[self.rank] = self.generation
        for fd in self.peer_fifos:
            try:
                os.write(fd, b"\0")
            except OSError as e:  # a full FIFO: that peer is not waiting and will see the flag
                if e.errno != errno.EAGAIN:
                    raise

    def _wait(self) -> None:
        deadline = None
        slept_through = False  # a whole _LIVENESS_S passed without a wake-up
        while min(self.flags.tolist()) < self.generation:
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                behind = [r for r, f in enumerate(self.flags.tolist()) if f < self.generation]
                raise TimeoutError(
                    f"rank {dist.get_rank()}: group ranks {behind} did not reach shared-memory "
                    f"collective {self.generation} within {self.timeout_s:.0f} s "
                    "(parallel.timeout_s)"
                )
            # Reading /proc costs more than most waits last: only a quiet peer is looked up.
            dead = slept_through and [pid for pid, start in self.peers if not _alive(pid, start)]
            if dead:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: a peer process ({', '.join(map(str, dead))}) "
                    f"exited during shared-memory collective {self.generation}"
                )
            ready, _, _ = select.select([self.own_fifo], [], [], min(left, _LIVENESS_S))
            slept_through = not ready
            if ready:
                try:
                    os.read(self.own_fifo, 4096)
                except BlockingIOError:
                    pass

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish x; every rank's x in group-rank order, as views into shared memory that stay
        valid until this rank's next-but-one collective."""
        self.generation += 1
        nbytes = x.numel() * x.element_size()
        self._slot(self.generation, self.rank, nbytes).view(x.dtype).view(x.shape).copy_(x)
        self._post()
        self._wait()
        return [
            self._slot(self.generation, r, nbytes).view(x.dtype).view(x.shape)
            for r in range(self.n)
        ]

    # ---- collectives (reductions run in group-rank order: identical on every rank) -------

    def all_gather(self, x: torch.Tensor, dim: int, out: torch.Tensor | None = None):
        return torch.cat(self.exchange(x), dim=dim, out=out)

    def reduce_scatter(self, y: torch.Tensor, dim: int, out: torch.Tensor | None = None):
        size = y.shape[dim] // self.n
        parts = [v.narrow(dim, self.rank * size, size) for v in self.exchange(y)]
        out = torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        return out

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        views = self.exchange(x)
        out = views[0].clone()
        for v in views[1:]:
            if op == "sum":
                out.add_(v)
            else:
                torch.maximum(out, v, out=out)
        return out


# ---- registry --------------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why this machine cannot use shared-memory collectives, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64 (the flags rely on x86-64 store order)"
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return "/dev/shm is missing or not writable"
    return None


def enable(group: dist.ProcessGroup, slot_bytes: int, timeout_s: float) -> ShmTransport:
    """The transport for `group` (reused when big enough). Collective: every group rank calls."""
    current = _TRANSPORTS.get(group.group_name)
    if current is not None and current.slot_bytes >= slot_bytes:
        return current
    transport = ShmTransport(group, slot_bytes, timeout_s)
    if current is not None:
        current.close()
    _TRANSPORTS[group.group_name] = transport
    return transport


def transport_for(group: dist.ProcessGroup) -> ShmTransport | None:
    return _TRANSPORTS.get(group.group_name) if _TRANSPORTS else None


def group_size(group_name: str) -> int:
    return _TRANSPORTS[group_name].n


def disable_all() -> None:
    for transport in _TRANSPORTS.values():
        transport.close()
    _TRANSPORTS.clear()


# ---- custom ops ------------------------------------------------------------------------------


@torch.library.custom_op("hybrid2d::shm_all_gather", mutates_args=())
def shm_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Every rank's x concatenated along dim."""
    return _TRANSPORTS[group_name].all_gather(x, dim)


@shm_all_gather.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] *= group_size(group_name)
    return x.new_empty(shape)


@torch.library.custom_op("hybrid2d::shm_reduce_scatter", mutates_args=())
def shm_reduce_scatter(y: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's 1/n slice along dim of the sum of every rank's y."""
    return _TRANSPORTS[group_name].reduce_scatter(y, dim)


@shm_reduce_scatter.register_fake
def _(y, dim, group_name):
    shape = list(y.shape)
    shape[dim] //= group_size(group_name)
    return y.new_empty(shape)


@torch.library.custom_op("hybrid2d::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """Sum or max of every rank's x."""
    return _TRANSPORTS[group_name].all_reduce(x, op)


@shm_all_reduce.register_fake
def _(x, op, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("hybrid2d::shm_all_gather_into", mutates_args=("out",))
def shm_all_gather_into(out: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
    """FSDP's flat all-gather: out = cat of every rank's flat x."""
    _TRANSPORTS[group_name].all_gather(x, 0, out=out)


@torch.library.custom_op("hybrid2d::shm_reduce_scatter_into", mutates_args=("out",))
def shm_reduce_scatter_into(out: torch.Tensor, y: torch.Tensor, group_name: str) -> None:
    """FSDP's flat reduce-scatter (sum)."""
    _TRANSPORTS[group_name].reduce_scatter(y, 0, out=out)


# ---- FSDP2 hooks -----------------------------------------------------------------------------


class ShmAllGather(AllGather):
    """FSDP2 all-gather through shared memory when the input fits, else the process group."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        transport = transport_for(group)
        if transport is None or not transport.fits(input_tensor):
            return dist.all_gather_single(output_tensor, input_tensor, group, async_op=async_op)
        torch.ops.hybrid2d.shm_all_gather_into(output_tensor, input_tensor, group.group_name)
        return None  # done; FSDP waits only on a returned work


class ShmReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter (sum or average) through shared memory when the input fits."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        transport = transport_for(group)
        average = op == dist.ReduceOp.AVG
        if (
            transport is None
            or not transport.fits(input_tensor)
            or not (average or op == dist.ReduceOp.SUM)
        ):
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        torch.ops.hybrid2d.shm_reduce_scatter_into(output_tensor, input_tensor, group.group_name)
        if average:
            output_tensor.div_(transport.n)
        return None


# ---- policy ----------------------------------------------------------------------------------


def _fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _largest_fsdp_reduce_bytes(model: torch.nn.Module, dp_shard: int) -> int:
    """Bytes of the largest reduce-scatter input of any FSDP unit: the unit's own parameters
    (not those of nested units), dp-unsharded, in fp32 (the widest reduce dtype)."""
    units = _fsdp_units(model)
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):  # parents come first in modules(): children overwrite
        for p in unit.parameters():
            owner[id(p)] = i
    numel = [0] * len(units)
    for p in model.parameters():
        if id(p) in owner:
            local = p.to_local() if hasattr(p, "to_local") else p
            numel[owner[id(p)]] += local.numel() * dp_shard
    return max(numel) * 4


def apply_shm_collectives(model, mesh, setting: str, activation_bytes: int, timeout_s: float):
    """parallel.shm_collectives: route tp and FSDP collectives of ranks on this host through
    shared memory. Returns one line saying what was done (None when nothing applies).

    `activation_bytes`: the largest sequence-parallel collective input of a rank, i.e. one micro
    batch's [b, s, dim] activations in fp32.
    """
    if setting == "off" or mesh.device.type != "cpu" or dist.get_backend() != "gloo":
        return None
    groups = []
    if mesh.tp > 1:
        groups.append(("tp", mesh.tp_mesh.get_group(), activation_bytes))
    if mesh.dp_shard > 1:
        slot = _largest_fsdp_reduce_bytes(model, mesh.dp_shard)
        groups.append(("dp_shard", mesh.mesh["dp_shard"].get_group(), slot))
    if not groups:
        return None
    reason = unavailable_reason()
    enabled, failures = [], []
    for name, group, slot in groups:
        if reason is None:
            try:
                enable(group, slot, timeout_s)
                enabled.append(f"{name} ({2 * dist.get_world_size(group) * slot / 2**20:.1f} MiB)")
                continue
            except ShmUnavailable as e:
                failures.append(f"{name}: {e}")
        else:
            failures.append(f"{name}: {reason}")
    if setting == "on":
        # Every rank stops, also those whose own groups worked (no rank waits for the others).
        failed = torch.tensor([1 if failures else 0])
        dist.all_reduce(failed)
        if failed.item():
            disable_all()
            raise ConfigError(
                "parallel.shm_collectives=on but shared memory is unavailable: "
                + ("; ".join(failures) or "on another rank")
                + "; use auto (falls back to the process group) or off"
            )
    if mesh.dp_shard > 1 and transport_for(groups[-1][1]) is not None:
        for unit in _fsdp_units(model):
            unit.set_custom_all_gather(ShmAllGather())
            unit.set_custom_reduce_scatter(ShmReduceScatter())
    line = "shared-memory collectives: " + (", ".join(enabled) or "none")
    return line + (f"; process group for {'; '.join(failures)}" if failures else "")
