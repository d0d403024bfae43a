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

from hybrid2d.errors import ConfigError

BACKEND = "hybrid2d_shm"
SLOT_CAP_BYTES = 256 << 20  # per rank and generation; larger inputs go to gloo
_INITIAL_SLOT_BYTES = 64 << 10
_LINE = 64  # one header line per (parity, rank): no two ranks write one cache line
_LIVENESS_S = 0.25  # a wait that slept this long checks that its peers are alive
_MESSAGE_BYTES = 4096  # set-up messages exchanged over the inner gloo group
_SETTINGS = ("auto", "on", "off")
_setting = "auto"

_FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REDUCIBLE = (*_FLOATING, torch.int64, torch.int32)
_DTYPES = (*_REDUCIBLE, torch.int16, torch.int8, torch.uint8, torch.bool)
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPES)}

# Header op codes, and for each the name a mismatch error prints, the dtypes shared memory
# serves (an integer average goes to gloo, which rounds it its own way) and the c10d op it
# stands for (see DISPATCH_OPS).
_ALL_GATHER = 1
_REDUCE_SCATTER_SUM = 2
_REDUCE_SCATTER_AVG = 3
_ALL_REDUCE_SUM = 4
_ALL_REDUCE_MAX = 5
_OPS = {
    _ALL_GATHER: ("all_gather", _DTYPES, "_allgather_base_"),
    _REDUCE_SCATTER_SUM: ("reduce_scatter", _REDUCIBLE, "_reduce_scatter_base_"),
    _REDUCE_SCATTER_AVG: ("reduce_scatter(avg)", _FLOATING, "_reduce_scatter_base_"),
    _ALL_REDUCE_SUM: ("all_reduce", _REDUCIBLE, "allreduce_"),
    _ALL_REDUCE_MAX: ("all_reduce(max)", _REDUCIBLE, "allreduce_"),
}
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


class _Unavailable(Exception):
    """Shared memory cannot serve this group; the message is the same on every rank."""


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
    """Make `BACKEND` known to torch.distributed (idempotent). torch constructs a
    `ShmProcessGroup` on the members of each new group with this backend, all at once."""
    if getattr(dist.Backend, BACKEND.upper(), None) is None:
        dist.Backend.register_backend(BACKEND, ShmProcessGroup, extended_api=True, devices=["cpu"])


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
    pg = group or dist.group.WORLD
    return isinstance(pg, ShmProcessGroup) and pg._shm is not None


def fallback_reason(group: dist.ProcessGroup | None = None) -> str | None:
    """Why `group` delegates everything to gloo (None when it uses shared memory)."""
    pg = group or dist.group.WORLD
    return pg._fallback if isinstance(pg, ShmProcessGroup) else f"not a {BACKEND} group"


def collective_count(group: dist.ProcessGroup | None = None) -> int:
    """Collectives this rank has served through shared memory in `group` (its generation)."""
    pg = group or dist.group.WORLD
    return pg._shm.generation if isinstance(pg, ShmProcessGroup) and pg._shm else 0


# Seconds this process has spent blocked in `_Transport.wait` for peers that had not posted yet,
# over every group: the exposed communication the step breakdown reports (metrics/step_clock.py).
_waited = [0.0]


def waited_seconds() -> float:
    """Seconds this process has waited for peers in shared-memory collectives, all groups."""
    return _waited[0]


def _on_error(reason: str) -> str:
    return (
        f"parallel.shm_collectives=on but shared memory is unavailable: {reason}; "
        "use auto (falls back to the process group) or off"
    )


# A finished Work, returned by every shared-memory collective (they end before returning). A
# Python `dist.Work` subclass would be the public way, but its is_completed() stays False;
# `_create_work_from_future` gives a C++ work that reports done. Move to a public constructor
# when torch has one.
_finished = torch.futures.Future()
_finished.set_result(None)
_DONE = torch._C._distributed_c10d._create_work_from_future(_finished)

# ---- visible to dispatch modes ---------------------------------------------------------------
#
# gloo's collectives reach the dispatcher as c10d ops (c10d._allgather_base_, ...), which is how
# CommDebugMode and other TorchDispatchModes see them; a Python process group's methods are
# plain calls. So while such a mode is active, the shared-memory path runs as ops of the same
# names in this library (same transport, so every rank still does the same): add
# `DISPATCH_OPS` to a CommDebugMode's comm_registry to count them. Each takes (output, input,
# header op code, group name), as the c10d op takes (output, input, ...), and returns whether
# shared memory served the call (False: the caller falls back to gloo). Without a mode the path
# costs one C call to check.

_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # group name -> group
_lib = torch.library.Library(BACKEND, "DEF")
# torch._C._len_torch_dispatch_stack: the public way, torch.utils._python_dispatch's
# _get_current_dispatch_mode, is private as well and costs more.
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _kernel(output, input, op, group):
    return _GROUPS[group]._shm.run(op, input, output)


_NAMES = ("_allgather_base_", "_reduce_scatter_base_", "allreduce_")  # those of c10d's ops
for _name in _NAMES:
    _lib.define(f"{_name}(Tensor(a!) output, Tensor input, int op, str group) -> bool")
    _lib.impl(_name, _kernel, "CPU")
_ns = getattr(torch.ops, BACKEND)
# Each dispatcher op, and the c10d op gloo would have shown in its place (for reports).
DISPATCH_OPS = {getattr(_ns, name): f"c10d.{name}" for name in _NAMES}


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


def _identity(fd: int) -> list[int]:
    st = os.fstat(fd)
    return [st.st_dev, st.st_ino]


def _open_shared_fd(flags: int, pid: int, fd: int, *identity: int) -> int:
    """Open a descriptor a process shared, through /proc, and check it is the object it named
    (a pid of another PID namespace or a reused one names something else or nothing)."""
    opened = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    if _identity(opened) != list(identity):
        os.close(opened)
        raise OSError(f"/proc/{pid}/fd/{fd} is not the object that process shared")
    return opened


# ---- the shared segment --------------------------------------------------------------------------


class _Transport:
    """Shared-memory exchange between the ranks of one group (see the module docstring)."""

    def __init__(self, pg: ShmProcessGroup, read_fd: int, write_fd: int, peers: list):
        self.pg = weakref.proxy(pg)  # no cycle: the group goes when its last user lets go
        self.n = pg._size
        self.rank = pg._rank
        self.read_fd = read_fd
        self.write_fd = write_fd  # kept open: our pipe never reads as end-of-file
        self.peer_fds: list[tuple[int, int]] = []  # (group rank, write end of its pipe)
        self.peers = peers  # [(pid, start time)] by group rank
        self.mm: mmap.mmap | None = None  # the segment, with `slot` bytes per slot (see map)
        self.generation = 0
        self.broken: str | None = None
        self.poll = select.poll()
        self.poll.register(read_fd, select.POLLIN)
        self.lines = struct.Struct("<" + "qqqqq24x" * self.n)
        self.sleepers = struct.Struct("<" + "q56x" * self.n)
        self.sleep_offset = 2 * self.n * _LINE
        self.cap = SLOT_CAP_BYTES

    def map(self, mm: mmap.mmap, slot: int) -> None:
        """Serve from `mm`, the group's segment with `slot` bytes per slot (a new one after a
        growth: every peer moved with us)."""
        if self.mm is not None:
            self.unmap()
        self.mm, self.slot = mm, slot
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.cache: dict[tuple, tuple] = {}  # collective shape -> views (see views)

    def unmap(self) -> None:
        self.cache.clear()
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a view escaped: the mapping goes with its last user
            pass

    # ---- one collective ------------------------------------------------------------------------

    def views(self, kind: int, dtype: torch.dtype, numel: int, parity: int) -> tuple:
        """(own slot, peers' data) for one collective shape, cached."""
        key = (kind, dtype, numel, parity)
        v = self.cache.get(key)
        if v is None:
            n, r = self.n, self.rank
            base = self.bytes.view(dtype)
            stride = self.slot // base.element_size()  # from one slot to the next
            first = (3 * n * _LINE) // base.element_size() + parity * n * stride
            every = base[first:].as_strided((n, numel), (stride, 1))  # the n slots
            if kind == _ALL_GATHER:  # all slots; those before and after ours
                peers = (every, every[:r], every[r + 1 :])
            elif kind in (_REDUCE_SCATTER_SUM, _REDUCE_SCATTER_AVG):  # our chunk of each
                peers = tuple(every[:, r * numel // n : (r + 1) * numel // n])
            else:
                peers = tuple(every)
            if len(self.cache) > 256:
                self.cache.clear()
            v = self.cache[key] = (every[r], peers)
        return v

    def run(self, kind: int, inp: torch.Tensor, out: torch.Tensor) -> bool:
        """One collective through shared memory; False (nothing done) when it must go to gloo."""
        if self.broken:
            raise dist.DistBackendError(self.broken)
        numel = inp.numel()
        nbytes = numel * inp.element_size()
        if nbytes > self.slot:
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
            return True
        if out.dim() != 1:
            out = out.view(-1)
        if kind == _ALL_REDUCE_MAX:
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
        mm = self.mm
        line = (parity * self.n + self.rank) * _LINE
        code = _DTYPE_CODES[dtype]
        _FIELDS.pack_into(mm, line + 8, kind, code, numel, grow)
        _GENERATION.pack_into(mm, line, g)
        # Wake the peers that sleep waiting for this generation. The fence orders our store
        # of g before our load of their sleep flags; a waiter orders its store of the flag
        # before its last look at ours: one of the two sees the other.
        _FENCE.acquire()
        _FENCE.release()
        sleeping = self.sleepers.unpack_from(mm, self.sleep_offset)
        for q, fd in self.peer_fds:
            if sleeping[q] == g:
                # A full pipe: that peer wakes anyway; a broken one: a wait names the lost peer.
                try:
                    os.write(fd, b"\0")
                except (BlockingIOError, BrokenPipeError):
                    pass
        expected = (g, kind, code, numel, grow) * self.n
        offset = parity * self.n * _LINE
        if self.lines.unpack_from(mm, offset) != expected:
            start = time.perf_counter()
            try:
                self.wait(g, expected, offset)
            finally:
                _waited[0] += time.perf_counter() - start

    def wait(self, g: int, expected: tuple, offset: int) -> None:
        """Until every peer posted generation g: raise on a mismatch, a timeout, a dead peer."""
        # Announce the sleep, then look again (see exchange).
        _GENERATION.pack_into(self.mm, self.sleep_offset + self.rank * _LINE, g)
        _FENCE.acquire()
        _FENCE.release()
        deadline = time.monotonic() + self.pg._timeout_s
        slept_through = False  # a whole _LIVENESS_S passed without a wake-up
        while (seen := self.lines.unpack_from(self.mm, offset)) != expected:
            behind = []
            for q in range(self.n):
                if seen[5 * q] != g:
                    behind.append(q)
                elif seen[5 * q : 5 * q + 5] != expected[:5]:
                    self.fail(
                        f"shared-memory collective {g} mismatch: this rank "
                        f"{_describe_call(expected[1:5])}, group rank {q} "
                        f"{_describe_call(seen[5 * q + 1 : 5 * q + 5])}"
                    )
            now = time.monotonic()
            if now >= deadline:
                self.fail(
                    f"shared-memory collective {g} ({_describe_call(expected[1:5])}) timed out "
                    f"after {self.pg._timeout_s:.0f} s waiting for group ranks {behind} "
                    f"(ranks {[self.pg._global_ranks[q] for q in behind]})"
                )
            if slept_through:  # reading /proc costs more than most waits last
                for q in behind:
                    pid, start = self.peers[q]
                    if _start_time(pid) != start:
                        self.fail(
                            f"group rank {q} (rank {self.pg._global_ranks[q]}, pid {pid}) "
                            f"exited during shared-memory collective {g}"
                        )
            ready = self.poll.poll(min(deadline - now, _LIVENESS_S) * 1000)
            slept_through = not ready
            if ready:
                try:
                    os.read(self.read_fd, 65536)
                except BlockingIOError:
                    pass

    def fail(self, what: str):
        """Raise `what` for this rank; the group is broken from now on."""
        self.broken = self.pg._err(what)
        raise dist.DistBackendError(self.broken)

    def grow(self, needed: int) -> bool:
        """Every rank asked for `needed` bytes: a new segment with bigger slots (over gloo).
        False when it could not be made (the group then serves larger inputs through gloo)."""
        slot = min(self.cap, max(2 * self.slot, 1 << (needed - 1).bit_length()))
        slot = -(-slot // _LINE) * _LINE  # every dtype's view of a slot stays aligned
        try:
            self.map(self.pg._share_segment(slot, "grow"), slot)
        except _Unavailable as e:
            if _setting == "on":
                raise ConfigError(_on_error(str(e))) from None
            self.cap = self.slot
            return False
        return True

    def close(self) -> None:
        for fd in [self.read_fd, self.write_fd, *(fd for _, fd in self.peer_fds)]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.peer_fds = []
        if self.mm is not None:
            self.unmap()


def _describe_call(fields) -> str:
    """(op, dtype code, numel, grow) of a slot header as "all_gather float32[1024]"."""
    kind, code, numel, grow = fields
    dtype = str(_DTYPES[code - 1]).removeprefix("torch.")
    return f"{_OPS[kind][0]} {dtype}[{numel}]" + (" (growing)" if grow else "")


# ---- the process group ---------------------------------------------------------------------------


class ShmProcessGroup(dist.ProcessGroup):
    """A process group that serves flat all-gather, reduce-scatter and all-reduce of CPU tensors
    through shared memory and delegates every other call to an inner gloo group.

    torch reaches a Python process group two ways: Python calls its methods by name
    (`dist.all_gather_into_tensor` -> `all_gather_single`), and C++ calls the virtuals its
    trampoline forwards to Python (functional collectives -> `all_gather_single_coalesced`,
    DeviceMesh -> `getGroupName`). The methods below are those names, once each.
    """

    def __init__(self, opts, backend_options=None):
        """From torch's `_DistributedBackendOptions` (see `register`)."""
        rank, size, timeout = opts.group_rank, opts.group_size, opts.timeout
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout_s = timeout.total_seconds()
        self._global_ranks = list(opts.global_ranks_in_group) or list(range(size))
        self._global_rank = self._global_ranks[rank]
        self._name = opts.group_id
        _GROUPS[self._name] = self
        self._shm: _Transport | None = None
        self._fallback: str | None = None
        store = dist.PrefixStore("gloo/", opts.store)
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
        gloo.options.global_ranks_in_group = self._global_ranks
        gloo.options.group_name = self._name
        gloo._set_sequence_number_for_group()
        inner = dist.ProcessGroup(opts.store, rank, size)
        inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        inner._set_group_name(self._name)
        self._inner = inner
        try:
            self._set_up()
        except BaseException:
            self.shutdown()
            raise

    # ---- identity: the C++ virtuals (the Python properties group_name, name() read them) ------

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name
        _GROUPS[name] = self
        if self._inner is not None:
            self._inner._set_group_name(name)

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device):
        """The gloo backend, for any device (what FSDP and c10d ask about allocation)."""
        return self._gloo_group()._get_backend(torch.device("cpu"))

    def _gloo_group(self) -> dist.ProcessGroup:
        """The inner group that serves everything without a shared-memory path."""
        if self._inner is None:
            raise RuntimeError(f"{BACKEND} group {self._name} was shut down")
        return self._inner

    def __repr__(self) -> str:
        how = "shared memory" if self._shm else f"gloo ({self._fallback})"
        return f"<ShmProcessGroup {self._name} rank {self._rank}/{self._size} via {how}>"

    # ---- set-up ----------------------------------------------------------------------------------

    def _err(self, what: str) -> str:
        return f"rank {self._global_rank}: {what}"

    def _allgather_json(self, obj) -> list:
        """Every group rank's `obj`, over the inner gloo group (fails fast if a peer dies)."""
        data = json.dumps(obj).encode()
        if len(data) > _MESSAGE_BYTES:
            raise ValueError(f"set-up message of {len(data)} bytes is too long")
        # Padded with spaces, which JSON ignores.
        buf = torch.frombuffer(bytearray(data.ljust(_MESSAGE_BYTES)), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self._size)]
        self._inner.allgather([outs], [buf]).wait()
        return [json.loads(out.numpy().tobytes()) for out in outs]

    def _agree(self, error: str | None) -> None:
        """Collective: if any rank has an error, every rank raises the first one."""
        errors = [e for e in self._allgather_json(error) if e]
        if errors:
            raise _Unavailable(errors[0])

    def _set_up(self) -> None:
        """Collective over the group: the transport, or the reason it delegates to gloo."""
        if self._size == 1:
            self._fallback = "one rank"
        elif _setting == "off":
            self._fallback = "parallel.shm_collectives=off"
        else:
            try:
                self._shm = self._connect()
            except _Unavailable as e:
                if _setting == "on":
                    raise ConfigError(_on_error(str(e))) from None
                self._fallback = str(e)

    def _connect(self) -> _Transport | None:
        """Wake-up pipes, the segment and the peers' pipes, agreed step by step; None (with
        the reason in _fallback) for a group that spans hosts, which is no error even under
        "on"."""
        error = unavailable_reason()
        read_fd = write_fd = shm = None
        me = {"host": _host_id(), "pid": os.getpid(), "start": _start_time(os.getpid())}
        try:
            if error is None:
                try:
                    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                    me["pipe"] = [os.getpid(), write_fd, *_identity(write_fd)]
                except OSError as e:
                    error = f"cannot make a pipe: {e}"
            _setup_point("pipe")
            me["error"] = error and self._err(error)
            everyone = self._allgather_json(me)
            if len({e["host"] for e in everyone}) > 1:
                self._fallback = "group spans hosts"
                return None
            failed = [e["error"] for e in everyone if e["error"]]
            if failed:  # every rank has every error: no further exchange needed
                raise _Unavailable(failed[0])
            shm = _Transport(self, read_fd, write_fd, [(e["pid"], e["start"]) for e in everyone])
            read_fd = write_fd = None  # the transport owns them now
            shm.map(self._share_segment(_INITIAL_SLOT_BYTES, "set-up"), _INITIAL_SLOT_BYTES)
            error = None
            try:
                for q, e in enumerate(everyone):
                    if q != self._rank:
                        fd = _open_shared_fd(os.O_WRONLY | os.O_NONBLOCK, *e["pipe"])
                        shm.peer_fds.append((q, fd))
            except OSError as e:
                error = self._err(f"cannot open a peer's wake-up pipe: {e}")
            _setup_point("pipes_opened")
            self._agree(error)
        except BaseException:
            if shm is not None:
                shm.close()
            raise
        finally:
            for fd in (read_fd, write_fd):
                if fd is not None:
                    os.close(fd)
        _setup_point("done")
        return shm

    def _share_segment(self, slot: int, step: str) -> mmap.mmap:
        """Group rank 0 makes a segment with `slot` bytes per slot; every rank maps it.
        Collective; raises _Unavailable on every rank with the first error."""
        total = self._size * (3 * _LINE + 2 * slot)  # header, sleep lines, slots
        fd = mm = None
        message = {"error": None}
        try:
            if self._rank == 0:
                try:
                    fd = os.memfd_create(BACKEND, os.MFD_CLOEXEC)
                    os.ftruncate(fd, total)
                    # Reserve the pages now: running out fails here, not with SIGBUS later.
                    os.posix_fallocate(fd, 0, total)
                    message["segment"] = [os.getpid(), fd, *_identity(fd)]
                except OSError as e:
                    what = f"cannot make a {total / 2**20:.1f} MiB shared segment: {e}"
                    message["error"] = self._err(what)
            _setup_point(f"{step}:segment")
            creator = self._allgather_json(message)[0]
            if creator["error"]:
                raise _Unavailable(creator["error"])
            error = None
            try:  # group rank 0 as well, through its own /proc entry
                opened = _open_shared_fd(os.O_RDWR, *creator["segment"])
                try:
                    mm = mmap.mmap(opened, total)
                finally:
                    os.close(opened)
            except (OSError, ValueError) as e:
                error = self._err(f"cannot map group rank 0's segment: {e}")
            _setup_point(f"{step}:mapped")
            self._agree(error)
            return mm
        except BaseException:
            if mm is not None:
                mm.close()
            raise
        finally:
            if fd is not None:  # every rank mapped it or failed: the mappings keep it alive
                os.close(fd)

    # ---- collectives with a shared-memory path ---------------------------------------------------

    def _served(self, kind: int | None, input: torch.Tensor, output: torch.Tensor) -> bool:
        """Run one collective (header op `kind`, None: no shared-memory path) through shared
        memory if the tensors allow it; False when nothing was done and gloo must serve it."""
        if not (
            self._shm is not None
            and kind is not None
            and input.is_cpu
            and output.is_cpu
            and input.dtype == output.dtype
            and input.dtype in _OPS[kind][1]
            and input.layout is torch.strided
            and input.is_contiguous()
            and output.is_contiguous()
        ):
            return False
        if _dispatch_modes():
            return getattr(_ns, _OPS[kind][2])(output, input, kind, self._name)
        return self._shm.run(kind, input, output)

    def all_gather_single(self, output, input, *opts):
        """dist.all_gather_into_tensor (FSDP2's all-gather)."""
        if output.numel() == input.numel() * self._size and self._served(
            _ALL_GATHER, input, output
        ):
            return _DONE
        return self._gloo_group().all_gather_single(output, input, *opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """dist.reduce_scatter_tensor (FSDP2's reduce-scatter): sum and average."""
        opts = opts or dist.ReduceScatterOptions()
        kind = _RS_OPS.get(opts.reduceOp.op)
        if input.numel() == output.numel() * self._size and self._served(kind, input, output):
            return _DONE
        return self._gloo_group().reduce_scatter_single(output, input, opts)

    def allreduce(self, tensors, opts=None):
        """dist.all_reduce and functional all_reduce: sum and max."""
        opts = opts or dist.AllreduceOptions()
        if (
            type(tensors) is list
            and len(tensors) == 1
            and isinstance(opts, dist.AllreduceOptions)  # not the (tensors, ReduceOp) form
            and self._served(_AR_OPS.get(opts.reduceOp.op), tensors[0], tensors[0])
        ):
            return _DONE
        return self._gloo_group().allreduce(tensors, opts)

    # Functional collectives (all_gather_tensor, reduce_scatter_tensor, ...): one tensor takes
    # the path above.

    def all_gather_single_coalesced(self, outputs, inputs, *opts):
        if len(inputs) == 1 == len(outputs):
            return self.all_gather_single(outputs[0], inputs[0], *opts)
        return self._gloo_group().all_gather_single_coalesced(outputs, inputs, *opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if len(inputs) == 1 == len(outputs):
            return self.reduce_scatter_single(outputs[0], inputs[0], opts)
        opts = opts or dist.ReduceScatterOptions()
        return self._gloo_group().reduce_scatter_single_coalesced(outputs, inputs, opts)

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds()
        self._gloo_group().set_timeout(timeout)

    # ---- teardown --------------------------------------------------------------------------------

    def _close(self) -> None:
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is not None:
            shm.close()
            self._fallback = "shut down"

    __del__ = _close

    def shutdown(self, how: str = "shutdown") -> None:
        """destroy_process_group: unmap the segment, close the pipes, free the inner gloo group
        (its destructor joins gloo's threads)."""
        self._close()
        inner, self._inner = getattr(self, "_inner", None), None
        if inner is not None:
            getattr(inner, how)()

    def abort(self) -> None:
        self.shutdown("abort")


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._gloo_group(), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"ProcessGroup.{name}, served by the inner gloo group."
    return method


# Everything else torch calls on a group, as it is, to the inner gloo group.
for _name in (
    "allgather allgather_coalesced allreduce_coalesced all_to_all_single alltoall barrier "
    "monitored_barrier broadcast gather scatter reduce reduce_scatter send recv recv_anysource "
    "_start_coalescing _end_coalescing _get_sequence_number_for_group "
    "_set_sequence_number_for_group"
).split():
    setattr(ShmProcessGroup, _name, _delegate(_name))
del _name
