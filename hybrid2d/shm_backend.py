"""A torch.distributed backend for the ranks of one CPU host: collectives through shared memory.

Gloo moves every byte through loopback TCP and helper threads: on a CPU host a 1 MiB all-gather
costs more CPU per rank than the compute it serves for small per-rank work. This backend is
chosen once, when process groups are created (`init_process_group(backend=f"cpu:{BACKEND}")`),
and everything above the process group (DeviceMesh, DTensor, FSDP2, functional collectives, DCP)
reaches it without knowing: each group is a `ProcessGroup` subclass that serves flat all-gather,
reduce-scatter (sum, avg) and all-reduce (sum, max) of CPU tensors through one shared segment,
and delegates every other call to an inner gloo group built from the same store.

Transport (per group):
- One anonymous segment (`memfd_create`) made by group rank 0; the others open it through
  `/proc/<pid>/fd/<n>`. Nothing has a name, so a rank killed at any point leaves nothing behind:
  the kernel frees the segment with the last mapping.
- Layout: 2 x n header lines of 64 bytes ([parity][rank]: generation, op, dtype, numel, grow),
  n sleep lines (the generation a rank sleeps waiting for), then 2 x n slots ([parity][rank]).
  Collective g uses parity g % 2. A rank can start g + 2 (overwriting g's slot and line) only
  after every peer posted g + 1, which a peer does only after it finished reading g. Only
  x86-64: its stores become visible in program order, so a peer that sees a generation also
  sees the data and header written before it.
- A rank posts by writing its slot, its header fields, then its generation. A waiter that finds
  a peer missing announces in its sleep line that it sleeps and sleeps in `poll` on its wake-up
  pipe (`os.pipe()`, opened by the peers through /proc as well) instead of spinning on a core
  a peer needs; a poster writes one byte into the pipe of each peer that announced a sleep for
  its generation (no system call when nobody sleeps).
- After the wait every rank compares every peer's header with its own: a desynchronised
  collective raises on every rank at once, naming both calls. A wait that slept a whole
  `_LIVENESS_S` checks through /proc that the ranks it waits for are still alive.
- Reductions run in group-rank order on every rank (bit-identical results); all-gather writes
  straight into the output tensor.
- Slots grow lazily and in lockstep (every rank sees the same sizes for the same collective):
  a rank that needs a bigger slot posts a "grow" header instead of data, and once all agree the
  group re-handshakes over the inner gloo group. Inputs above `SLOT_CAP_BYTES` go to gloo.
- While a TorchDispatchMode is active (CommDebugMode), the same path runs as dispatcher ops,
  `DISPATCH_OPS`, so such modes can see the collectives.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import select
import struct
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from hybrid2d.config import ConfigError

BACKEND = "hybrid2d_shm"
SLOT_CAP_BYTES = 256 << 20  # per rank and generation; larger inputs go to gloo
_INITIAL_SLOT_BYTES = 64 << 10
_LINE = 64  # one header line per (parity, rank): no two ranks write one cache line
_LIVENESS_S = 0.25  # a wait that slept this long checks that its peers are alive
_MESSAGE_BYTES = 4096  # set-up messages exchanged over the inner gloo group
_SETTINGS = ("auto", "on", "off")
_setting = "auto"

# Header codes. The op names are what a mismatch error prints.
_ALL_GATHER = 1
_REDUCE_SCATTER_SUM = 2
_REDUCE_SCATTER_AVG = 3
_ALL_REDUCE_SUM = 4
_ALL_REDUCE_MAX = 5
_OP_NAMES = {
    _ALL_GATHER: "all_gather",
    _REDUCE_SCATTER_SUM: "reduce_scatter",
    _REDUCE_SCATTER_AVG: "reduce_scatter(avg)",
    _ALL_REDUCE_SUM: "all_reduce",
    _ALL_REDUCE_MAX: "all_reduce(max)",
}
_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_REDUCIBLE = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32}
_FLOATING = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
_RS_OPS = {dist.ReduceOp.SUM: _REDUCE_SCATTER_SUM, dist.ReduceOp.AVG: _REDUCE_SCATTER_AVG}
_AR_OPS = {dist.ReduceOp.SUM: _ALL_REDUCE_SUM, dist.ReduceOp.MAX: _ALL_REDUCE_MAX}
_FIELDS = struct.Struct("<qqqq")  # op, dtype, numel, grow (written before the generation)
_GENERATION = struct.Struct("<q")

# A full memory barrier between a store and a later load (x86 may reorder those two, and the
# sleep flags below need them ordered). Taking a lock is a locked read-modify-write, which is
# one on x86-64; the standard library offers no other way to emit it.
_FENCE = threading.Lock()


def _setup_point(name: str) -> None:
    """Marks each step of a set-up; tests replace it to kill a rank there."""


# ---- settings and registration -----------------------------------------------------------------


def configure(setting: str) -> None:
    """parallel.shm_collectives for groups created from now on: "auto" (shared memory where it
    works, else gloo), "on" (a group of one host that cannot set it up is an error), "off"
    (every group delegates to gloo)."""
    global _setting
    if setting not in _SETTINGS:
        raise ConfigError(
            f"parallel.shm_collectives={setting!r} is not one of {', '.join(_SETTINGS)}"
        )
    _setting = setting


def register() -> None:
    """Make `BACKEND` known to torch.distributed (idempotent)."""
    if getattr(dist.Backend, BACKEND.upper(), None) is None:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def unavailable_reason() -> str | None:
    """Why this process cannot use shared-memory collectives, or None.

    No /dev/shm is needed: segments are anonymous (memfd) and shared through /proc.
    """
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} is not Linux (segments are shared through /proc)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64 (the flags rely on x86-64 store order)"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing"
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "/proc is not mounted"
    return None


def uses_shared_memory(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (default: the default group) serves collectives through shared memory."""
    pg = _group(group)
    return isinstance(pg, ShmProcessGroup) and pg._shm is not None


def fallback_reason(group: dist.ProcessGroup | None = None) -> str | None:
    """Why `group` delegates everything to gloo (None when it uses shared memory)."""
    pg = _group(group)
    if not isinstance(pg, ShmProcessGroup):
        return f"not a {BACKEND} group"
    return pg._fallback


def collective_count(group: dist.ProcessGroup | None = None) -> int:
    """Collectives this rank has served through shared memory in `group` (its generation)."""
    pg = _group(group)
    return pg._shm.generation if isinstance(pg, ShmProcessGroup) and pg._shm else 0


def _group(group):
    return group if group is not None else dist.group.WORLD


def _create(opts, backend_options) -> ShmProcessGroup:
    # torch calls this on the members of each new group with this backend, all at once.
    return ShmProcessGroup(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        list(opts.global_ranks_in_group) or list(range(opts.group_size)),
        opts.group_id,
    )


def _completed_work() -> dist.Work:
    """A finished Work, returned by every shared-memory collective (they end before returning).

    The one public way is a Python `dist.Work` subclass, whose is_completed() stays False;
    `_create_work_from_future` gives a C++ work that reports done. Move to a public constructor
    when torch has one.
    """
    make = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)
    if make is not None:
        future = torch.futures.Future()
        future.set_result(None)
        return make(future)

    class _Done(dist.Work):
        def wait(self, timeout=None):
            return True

    return _Done()


_DONE = _completed_work()

# ---- visible to dispatch modes ---------------------------------------------------------------
#
# gloo's collectives reach the dispatcher as c10d ops (c10d._allgather_base_, ...), which is how
# CommDebugMode and other TorchDispatchModes see them; a Python process group's methods are
# plain calls. So while such a mode is active, the shared-memory path runs as these ops instead
# (same transport, so every rank still does the same): add `DISPATCH_OPS` to a CommDebugMode's
# comm_registry to count them. Each returns whether shared memory served the call (False: the
# caller falls back to gloo). Without a mode the path costs one C call to check.

_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # group name -> group
_lib = torch.library.Library(BACKEND, "DEF")
_lib.define("_allgather_base_(Tensor(a!) output_tensor, Tensor input_tensor, str group) -> bool")
_lib.define(
    "_reduce_scatter_base_(Tensor(a!) output_tensor, Tensor input_tensor, int op, str group) "
    "-> bool"
)
_lib.define("allreduce_(Tensor(a!) tensor, int op, str group) -> bool")
# torch._C._len_torch_dispatch_stack: the public way, torch.utils._python_dispatch's
# _get_current_dispatch_mode, is private as well and costs more.
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _all_gather_kernel(output, input, group):
    return _GROUPS[group]._shm.run(_ALL_GATHER, input, output)


def _reduce_scatter_kernel(output, input, op, group):
    return _GROUPS[group]._shm.run(op, input, output)


def _all_reduce_kernel(tensor, op, group):
    return _GROUPS[group]._shm.run(op, tensor, tensor.view(-1))


_lib.impl("_allgather_base_", _all_gather_kernel, "CPU")
_lib.impl("_reduce_scatter_base_", _reduce_scatter_kernel, "CPU")
_lib.impl("allreduce_", _all_reduce_kernel, "CPU")


class _ops:
    all_gather = torch.ops.hybrid2d_shm._allgather_base_
    reduce_scatter = torch.ops.hybrid2d_shm._reduce_scatter_base_
    all_reduce = torch.ops.hybrid2d_shm.allreduce_


# Each dispatcher op, and the c10d op gloo would have shown in its place (for reports).
DISPATCH_OPS = {
    _ops.all_gather: "c10d._allgather_base_",
    _ops.reduce_scatter: "c10d._reduce_scatter_base_",
    _ops.all_reduce: "c10d.allreduce_",
}


# ---- processes -----------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _host_id() -> str:
    """Equal for processes under one kernel (one host); tests replace it to fake a second host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return platform.node()


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _identity(fd: int) -> list[int]:
    st = os.fstat(fd)
    return [st.st_dev, st.st_ino]


def _open_peer_fd(pid: int, fd: int, flags: int, identity: list[int]) -> int:
    """Open another process's descriptor through /proc and check it is the object it named."""
    opened = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    if _identity(opened) != identity:
        os.close(opened)
        raise OSError(f"/proc/{pid}/fd/{fd} is not the object that process shared")
    return opened


# ---- the shared segment --------------------------------------------------------------------------


class _Segment:
    """One mapping of a group's segment: 2 x n header lines ([parity][rank]), n sleep lines (the
    generation a rank sleeps waiting for), then 2 x n slots ([parity][rank])."""

    def __init__(self, mm: mmap.mmap, n: int, slot: int):
        self.mm = mm
        self.n = n
        self.slot = slot
        self.sleep_offset = 2 * n * _LINE
        self.data_offset = 3 * n * _LINE
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.typed: dict[torch.dtype, torch.Tensor] = {}
        self.views: dict[tuple, tuple] = {}

    @staticmethod
    def size(n: int, slot: int) -> int:
        return 3 * n * _LINE + 2 * n * slot

    def slot_view(self, dtype: torch.dtype, parity: int, rank: int, numel: int) -> torch.Tensor:
        base = self.typed.get(dtype)
        if base is None:
            base = self.typed[dtype] = self.bytes.view(dtype)
        start = (self.data_offset + (parity * self.n + rank) * self.slot) // base.element_size()
        return base[start : start + numel]

    def close(self) -> None:
        self.views.clear()
        self.typed.clear()
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a view escaped: the mapping goes with its last user
            pass


class _Transport:
    """Shared-memory exchange between the ranks of one group (see the module docstring)."""

    def __init__(self, pg: ShmProcessGroup, read_fd: int, write_fd: int, peers: list, segment):
        self.pg = weakref.proxy(pg)  # no cycle: the group goes when its last user lets go
        self.n = pg._size
        self.rank = pg._rank
        self.read_fd = read_fd
        self.write_fd = write_fd  # kept open: our pipe never reads as end-of-file
        self.peer_fds: list[tuple[int, int]] = []  # (group rank, write end of its pipe)
        self.peers = peers  # [(pid, start time)] by group rank
        self.seg: _Segment = segment
        self.generation = 0
        self.broken: str | None = None
        self.poll = select.poll()
        self.poll.register(read_fd, select.POLLIN)
        self.lines = struct.Struct("<" + "qqqqq24x" * self.n)
        self.sleepers = struct.Struct("<" + "q56x" * self.n)
        self.cap = SLOT_CAP_BYTES
        self.quiet_sleeps = 0  # waits that slept a whole _LIVENESS_S (a slow or lost peer)

    # ---- one collective ------------------------------------------------------------------------

    def views(self, kind: int, dtype: torch.dtype, numel: int, parity: int) -> tuple:
        """(own slot, peers' data) for one collective shape, cached."""
        key = (kind, dtype, numel, parity)
        v = self.seg.views.get(key)
        if v is not None:
            return v
        seg, n, r = self.seg, self.n, self.rank
        own = seg.slot_view(dtype, parity, r, numel)
        if kind == _ALL_GATHER:  # every slot as one [n, numel] view; those before/after ours
            first = seg.slot_view(dtype, parity, 0, numel)
            every = first.as_strided((n, numel), (seg.slot // own.element_size(), 1))
            peers = (every, every[:r], every[r + 1 :])
        elif kind in (_REDUCE_SCATTER_SUM, _REDUCE_SCATTER_AVG):  # this rank's chunk of each
            chunk = numel // n
            peers = tuple(
                seg.slot_view(dtype, parity, q, numel)[r * chunk : (r + 1) * chunk]
                for q in range(n)
            )
        else:
            peers = tuple(seg.slot_view(dtype, parity, q, numel) for q in range(n))
        if len(seg.views) > 256:
            seg.views.clear()
        v = seg.views[key] = (own, peers)
        return v

    def run(self, kind: int, inp: torch.Tensor, out: torch.Tensor) -> bool:
        """One collective through shared memory; False (nothing done) when it must go to gloo."""
        if self.broken:
            raise RuntimeError(self.broken)
        numel = inp.numel()
        nbytes = numel * inp.element_size()
        if nbytes > self.seg.slot:
            if nbytes > self.cap:
                return False
            self.exchange(kind, inp.dtype, numel, grow=1)
            if not self.grow(nbytes):
                return False
        g = self.generation + 1
        own, peers = self.views(kind, inp.dtype, numel, g & 1)
        own.copy_(inp if inp.dim() == 1 else inp.view(-1))
        self.exchange(kind, inp.dtype, numel, grow=0)
        if kind == _ALL_GATHER:
            rows = out.view(self.n, numel)
            if inp.data_ptr() != out.data_ptr() + self.rank * nbytes:
                rows.copy_(peers[0])
            else:  # in place (FSDP2 gathers from its own row of the output): skip that row
                r = self.rank
                if r:
                    rows[:r].copy_(peers[1])
                if r + 1 < self.n:
                    rows[r + 1 :].copy_(peers[2])
        elif kind == _ALL_REDUCE_MAX:
            torch.maximum(peers[0], peers[1], out=out)
            for p in peers[2:]:
                torch.maximum(out, p, out=out)
        else:
            torch.add(peers[0], peers[1], out=out)
            for p in peers[2:]:
                out.add_(p)
            if kind == _REDUCE_SCATTER_AVG:
                out.div_(self.n)
        return True

    def exchange(self, kind: int, dtype: torch.dtype, numel: int, grow: int) -> None:
        """Post this rank's header for the next generation, wait for every peer's, compare."""
        g = self.generation = self.generation + 1
        parity = g & 1
        mm = self.seg.mm
        line = (parity * self.n + self.rank) * _LINE
        code = _DTYPE_CODES[dtype]
        _FIELDS.pack_into(mm, line + 8, kind, code, numel, grow)
        _GENERATION.pack_into(mm, line, g)
        # Wake the peers that sleep waiting for this generation. The fence orders our store
        # of g before our load of their sleep flags; a waiter orders its store of the flag
        # before its last look at ours: one of the two sees the other.
        _FENCE.acquire()
        _FENCE.release()
        sleeping = self.sleepers.unpack_from(mm, self.seg.sleep_offset)
        for q, fd in self.peer_fds:
            if sleeping[q] == g:
                try:
                    os.write(fd, b"\0")
                except BlockingIOError:  # a full pipe: that peer will wake anyway
                    pass
                except BrokenPipeError:  # that peer is gone: a wait names it
                    pass
        expected = (g, kind, code, numel, grow) * self.n
        offset = parity * self.n * _LINE
        seen = self.lines.unpack_from(mm, offset)
        if seen != expected:
            self.wait(g, expected, offset, seen)

    def wait(self, g: int, expected: tuple, offset: int, seen: tuple) -> None:
        deadline = None
        slept_through = False  # a whole _LIVENESS_S passed without a wake-up
        announced = False
        while seen != expected:
            behind = []
            for q in range(self.n):
                if seen[5 * q] != g:
                    behind.append(q)
                elif seen[5 * q : 5 * q + 5] != expected[:5]:
                    self.fail(self.mismatch(g, expected, seen, q))
            if not behind:
                break
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.pg._timeout_s
            if now >= deadline:
                self.fail(
                    f"rank {self.pg._global_rank}: shared-memory collective {g} "
                    f"({_describe_call(expected[1:5])}) timed out after "
                    f"{self.pg._timeout_s:.0f} s waiting for group ranks {behind} "
                    f"(ranks {[self.pg._global_ranks[q] for q in behind]})"
                )
            if not announced:  # announce the sleep, then look once more (see exchange)
                _GENERATION.pack_into(self.seg.mm, self.seg.sleep_offset + self.rank * _LINE, g)
                _FENCE.acquire()
                _FENCE.release()
                announced = True
                seen = self.lines.unpack_from(self.seg.mm, offset)
                continue
            if slept_through:  # reading /proc costs more than most waits last
                for q in behind:
                    pid, start = self.peers[q]
                    if _start_time(pid) != start:
                        self.fail(
                            f"rank {self.pg._global_rank}: group rank {q} (rank "
                            f"{self.pg._global_ranks[q]}, pid {pid}) exited during "
                            f"shared-memory collective {g}"
                        )
            ready = self.poll.poll(min(deadline - now, _LIVENESS_S) * 1000)
            slept_through = not ready
            self.quiet_sleeps += slept_through
            if ready:
                try:
                    os.read(self.read_fd, 65536)
                except BlockingIOError:
                    pass
            seen = self.lines.unpack_from(self.seg.mm, offset)

    def mismatch(self, g: int, expected: tuple, seen: tuple, q: int) -> str:
        theirs = _describe_call(seen[5 * q + 1 : 5 * q + 5])
        return (
            f"rank {self.pg._global_rank}: shared-memory collective {g} mismatch: this rank "
            f"{_describe_call(expected[1:5])}, group rank {q} {theirs}"
        )

    def fail(self, message: str):
        self.broken = message
        raise RuntimeError(message)

    def grow(self, needed: int) -> bool:
        """Every rank asked for `needed` bytes: a new segment with bigger slots (over gloo).
        False when it could not be made (the group then serves larger inputs through gloo)."""
        slot = min(self.cap, max(2 * self.seg.slot, 1 << (needed - 1).bit_length()))
        slot = -(-slot // _LINE) * _LINE  # every dtype's view of a slot stays aligned
        segment, error = self.pg._handshake_segment(slot, self.peers, "grow")
        if segment is None:
            if _setting == "on":
                raise ConfigError(_on_error(error))
            self.cap = self.seg.slot
            return False
        self.seg.close()
        self.seg = segment
        return True

    def close(self) -> None:
        for fd in [self.read_fd, self.write_fd, *(fd for _, fd in self.peer_fds)]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.peer_fds = []
        self.seg.close()


def _describe_call(fields) -> str:
    """(op, dtype code, numel, grow) of a slot header as "all_gather float32[1024]"."""
    kind, code, numel, grow = fields
    op = _OP_NAMES.get(kind, f"op {kind}")
    dtype = str(_DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(_DTYPES) else code
    return f"{op} {dtype}[{numel}]" + (" (growing)" if grow else "")


def _on_error(reason: str | None) -> str:
    return (
        f"parallel.shm_collectives=on but shared memory is unavailable: {reason}; "
        "use auto (falls back to the process group) or off"
    )


# ---- the process group ---------------------------------------------------------------------------


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._gloo_group(), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"ProcessGroup.{name}, served by the inner gloo group."
    return method


class ShmProcessGroup(dist.ProcessGroup):
    """A process group that serves flat all-gather, reduce-scatter and all-reduce of CPU tensors
    through shared memory and delegates every other call to an inner gloo group."""

    def __init__(self, store, rank, size, timeout, global_ranks, group_name):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout_s = timeout.total_seconds()
        self._global_ranks = global_ranks
        self._global_rank = global_ranks[rank]
        self._name = group_name
        _GROUPS[group_name] = self
        self._desc = "undefined"
        self._shm: _Transport | None = None
        self._fallback: str | None = None
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout=timeout)
        gloo.options.global_ranks_in_group = global_ranks
        gloo.options.group_name = group_name
        gloo._set_sequence_number_for_group()
        inner = dist.ProcessGroup(store, rank, size)
        inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        inner._set_group_name(group_name)
        self._gloo, self._inner = gloo, inner
        try:
            self._set_up()
        except BaseException:
            self.shutdown()
            raise

    # ---- identity (DeviceMesh needs a name; C++ reads it through getGroupName) ---------------

    @property
    def group_name(self) -> str:
        return self._name

    def getGroupName(self) -> str:  # the C++ virtual, for C++ callers
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name
        _GROUPS[name] = self
        if self._inner is not None:
            self._inner._set_group_name(name)

    setGroupName = _set_group_name

    @property
    def group_desc(self) -> str:
        return self._desc

    def getGroupDesc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    setGroupDesc = _set_group_desc

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def _get_backend(self, device):
        """The gloo backend (what FSDP and c10d ask about allocation and coalescing)."""
        self._gloo_group()
        return self._gloo

    def _gloo_group(self) -> dist.ProcessGroup:
        """The inner group that serves everything without a shared-memory path."""
        if self._inner is None:
            raise RuntimeError(f"{BACKEND} group {self._name} was shut down")
        return self._inner

    def __repr__(self) -> str:
        how = "shared memory" if self._shm else f"gloo ({self._fallback})"
        return f"<ShmProcessGroup {self._name} rank {self._rank}/{self._size} via {how}>"

    # ---- set-up ----------------------------------------------------------------------------------

    def _allgather_json(self, obj) -> list:
        """Every group rank's `obj`, over the inner gloo group (fails fast if a peer dies)."""
        data = json.dumps(obj).encode()
        if len(data) > _MESSAGE_BYTES - 4:
            raise ValueError(f"set-up message of {len(data)} bytes is too long")
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        buf[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self._size)]
        self._inner.allgather([outs], [buf]).wait()
        result = []
        for out in outs:
            raw = bytes(out.tolist())
            result.append(json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "little")]))
        return result

    def _set_up(self) -> None:
        """Collective over the group: the transport, or the reason it delegates to gloo."""
        _setup_point("start")
        if self._size == 1:
            self._fallback = "one rank"
            return
        if _setting == "off":
            self._fallback = "parallel.shm_collectives=off"
            return
        error = unavailable_reason()
        read_fd = write_fd = None
        me = {
            "host": _host_id(),
            "pidns": _pid_namespace(),
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
        }
        try:
            if error is None:
                try:
                    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                    me["pipe"] = [write_fd, *_identity(write_fd)]
                except OSError as e:
                    error = f"cannot make a pipe: {e}"
            _setup_point("pipe")
            me["error"] = error and f"rank {self._global_rank}: {error}"
            everyone = self._allgather_json(me)
            _setup_point("exchanged")
            if len({e["host"] for e in everyone}) > 1:
                self._fallback = "group spans hosts"
                return
            failed = [e["error"] for e in everyone if e["error"]]
            if not failed and len({e["pidns"] for e in everyone}) > 1:
                failed = ["the group's ranks are in different PID namespaces"]
            segment = None
            if not failed:
                peers = [(e["pid"], e["start"]) for e in everyone]
                segment, error = self._handshake_segment(_INITIAL_SLOT_BYTES, peers, "set-up")
                failed = [error] if segment is None else []
            if not failed:
                shm = _Transport(self, read_fd, write_fd, peers, segment)
                read_fd = write_fd = None  # the transport owns them now
                error = None
                try:
                    for q, e in enumerate(everyone):
                        if q != self._rank:
                            flags = os.O_WRONLY | os.O_NONBLOCK
                            fd = _open_peer_fd(e["pid"], e["pipe"][0], flags, e["pipe"][1:])
                            shm.peer_fds.append((q, fd))
                except OSError as e:
                    error = f"rank {self._global_rank}: cannot open a peer's wake-up pipe: {e}"
                _setup_point("pipes_opened")
                failed = [e for e in self._allgather_json(error) if e]
                if failed:
                    shm.close()
                else:
                    self._shm = shm
                    _setup_point("done")
                    return
            if _setting == "on":
                raise ConfigError(_on_error(failed[0]))
            self._fallback = failed[0]
        finally:
            for fd in (read_fd, write_fd):
                if fd is not None:
                    os.close(fd)

    def _handshake_segment(self, slot: int, peers: list, step: str):
        """Group rank 0 makes a segment with `slot` bytes per slot; every rank maps it.
        Collective; returns (segment, None) on every rank or (None, the first error)."""
        total = _Segment.size(self._size, slot)
        fd = None
        message = {"error": None}
        try:
            if self._rank == 0:
                try:
                    fd = os.memfd_create(BACKEND, os.MFD_CLOEXEC)
                    os.ftruncate(fd, total)
                    # Reserve the pages now: running out fails here, not with SIGBUS later.
                    os.posix_fallocate(fd, 0, total)
                    message["segment"] = [fd, *_identity(fd)]
                except OSError as e:
                    message["error"] = (
                        f"rank {self._global_rank}: cannot make a {total / 2**20:.1f} MiB "
                        f"shared segment: {e}"
                    )
            _setup_point(f"{step}:segment")
            creator = self._allgather_json(message)[0]
            error, mm = creator["error"], None
            if error is None:
                try:
                    if self._rank == 0:
                        mm = mmap.mmap(fd, total)
                    else:
                        seg_fd, *identity = creator["segment"]
                        opened = _open_peer_fd(peers[0][0], seg_fd, os.O_RDWR, identity)
                        try:
                            mm = mmap.mmap(opened, total)
                        finally:
                            os.close(opened)
                except (OSError, ValueError) as e:
                    error = f"rank {self._global_rank}: cannot map group rank 0's segment: {e}"
            _setup_point(f"{step}:mapped")
            errors = [e for e in self._allgather_json(error) if e]
            if errors:
                if mm is not None:
                    mm.close()
                return None, errors[0]
            return _Segment(mm, self._size, slot), None
        finally:
            if fd is not None:  # every rank mapped it or failed: the mappings keep it alive
                os.close(fd)

    # ---- collectives with a shared-memory path ---------------------------------------------------

    def all_gather_single(self, output, input, *args, **kwargs):
        """dist.all_gather_into_tensor / all_gather_single (FSDP2's all-gather)."""
        shm = self._shm
        if (
            shm is not None
            and input.is_cpu
            and output.is_cpu
            and input.dtype == output.dtype
            and input.layout is torch.strided
            and input.is_contiguous()
            and output.is_contiguous()
            and output.numel() == input.numel() * self._size
            and input.dtype in _DTYPE_CODES
            and (
                _ops.all_gather(output, input, self._name)
                if _dispatch_modes()
                else shm.run(_ALL_GATHER, input, output)
            )
        ):
            return _DONE
        return self._gloo_group().all_gather_single(output, input, *args, **kwargs)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, *args, **kwargs):
        """Functional collectives' all-gather (all_gather_tensor, all_gather_single)."""
        if len(inputs) == 1 and len(outputs) == 1:
            return self.all_gather_single(outputs[0], inputs[0], *args, **kwargs)
        return self._gloo_group().all_gather_single_coalesced(outputs, inputs, *args, **kwargs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output, input, opts=None, *args, **kwargs):
        """dist.reduce_scatter_tensor / reduce_scatter_single (FSDP2's reduce-scatter)."""
        shm = self._shm
        if (
            shm is not None
            and opts is not None
            and input.is_cpu
            and output.is_cpu
            and input.dtype == output.dtype
            and input.layout is torch.strided
            and input.is_contiguous()
            and output.is_contiguous()
            and input.numel() == output.numel() * self._size
            and input.dtype in _REDUCIBLE
        ):
            kind = _RS_OPS.get(opts.reduceOp.op)
            if kind is not None and (kind == _REDUCE_SCATTER_SUM or input.dtype in _FLOATING):
                out = output.view(-1)
                if (
                    _ops.reduce_scatter(out, input, kind, self._name)
                    if _dispatch_modes()
                    else shm.run(kind, input, out)
                ):
                    return _DONE
        if opts is None:
            return self._gloo_group().reduce_scatter_single(output, input, *args, **kwargs)
        return self._gloo_group().reduce_scatter_single(output, input, opts, *args, **kwargs)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, *args, **kwargs):
        """Functional collectives' reduce-scatter (reduce_scatter_tensor, _single)."""
        if len(inputs) == 1 and len(outputs) == 1:
            return self.reduce_scatter_single(outputs[0], inputs[0], *args, **kwargs)
        return self._gloo_group().reduce_scatter_single_coalesced(outputs, inputs, *args, **kwargs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allreduce(self, tensors, opts=None, *args, **kwargs):
        """dist.all_reduce and functional all_reduce (sum and max through shared memory)."""
        shm = self._shm
        if shm is not None and type(tensors) is list and len(tensors) == 1 and not args:
            t = tensors[0]
            if (
                isinstance(opts, dist.AllreduceOptions)
                and t.is_cpu
                and t.layout is torch.strided
                and t.is_contiguous()
                and t.dtype in _REDUCIBLE
            ):
                kind = _AR_OPS.get(opts.reduceOp.op)
                if kind is not None and (
                    _ops.all_reduce(t, kind, self._name)
                    if _dispatch_modes()
                    else shm.run(kind, t, t.view(-1))
                ):
                    return _DONE
        if opts is None:
            return self._gloo_group().allreduce(tensors, *args, **kwargs)
        return self._gloo_group().allreduce(tensors, opts, *args, **kwargs)

    # ---- everything else: the inner gloo group ---------------------------------------------------

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds()
        self._gloo_group().set_timeout(timeout)

    # ---- teardown --------------------------------------------------------------------------------

    def _close(self) -> None:
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is not None:
            shm.close()
            self._fallback = "shut down"

    def shutdown(self) -> None:
        """destroy_process_group: unmap the segment, close the pipes, free the inner gloo group
        (its destructor joins gloo's threads)."""
        self._close()
        inner, self._inner, self._gloo = getattr(self, "_inner", None), None, None
        if inner is not None:
            inner.shutdown()

    def abort(self) -> None:
        self._close()
        inner, self._inner, self._gloo = getattr(self, "_inner", None), None, None
        if inner is not None:
            inner.abort()

    def __del__(self):
        self._close()


for _name in (
    "allgather",
    "allgather_coalesced",
    "allreduce_coalesced",
    "all_to_all_single",
    "alltoall_base",
    "alltoall",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "send",
    "recv",
    "recv_anysource",
    "_start_coalescing",
    "_end_coalescing",
    "_get_sequence_number_for_group",
    "_set_sequence_number_for_group",
):
    setattr(ShmProcessGroup, _name, _delegate(_name))
del _name
