"""Save and resume the whole training state as torch.distributed.checkpoint (DCP) directories.

The state saved is one nested dict (the layout the HF converter shares):

    {"model":     get_model_state_dict(model)       HF LlamaForCausalLM keys, sharded DTensors
     "optimizer": get_optimizer_state_dict(...)     keyed by the same names, sharded like them
     "trainer":   {"step", "scheduler", "rng": {...}, "data": {samples_consumed, seed}}}

The Checkpointer is given the objects that own these parts (`Stateful`: `state_dict` and
`load_state_dict`), each at its place in that dict, and knows nothing else of the run: what a
load means for an object (the optimizer taking this launch's lr again) is the object's business.

Every rank writes only its own shards; DCP records each shard's global offsets, so a checkpoint
saved on one mesh loads on any other mesh and world size (DCP reshards on load). The data
position is global, so the resumed run also sees the batches the straight run would have seen.

Crash safety (see layout.py): a save writes `step-N.tmp`; once every rank finished, the ranks
hash the files, rank 0 writes checksums.json, renames the directory to `step-N`, and replaces the
`latest` pointer last. With async_save the state is copied to CPU memory at the save call, and
the writing, hashing and publishing run in a background thread on a separate gloo process group
while training goes on; the next save (or the end of the run) waits for it.

A save that fails on any rank (a full disk, a peer gone) fails on every rank: after writing,
the ranks exchange their errors before anything is published, the step's directory is removed,
and the next save (or the end of the run) raises one SaveError naming the rank, the step, the
path and the cause on every rank, so no rank waits for one that gave up and nothing is lost.

Resuming checks everything it can on every rank before the first collective (path, metadata,
key names and shapes, file sizes, checksums), then all ranks agree on the outcome, so a bad
checkpoint is one ConfigError on every rank rather than a rank waiting for a dead peer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from hybrid2d.checkpoint import integrity, layout
from hybrid2d.checkpoint.adapters import check_same_base, run_model_shapes
from hybrid2d.checkpoint.hf_tokens import source_files
from hybrid2d.checkpoint.reader import (
    TRAINER,
    as_config_error,
    cause,
    check_model_shapes,
    first_line,
    read_config,
    read_metadata,
)
from hybrid2d.checkpoint.safe_metadata import MetadataReader, SafeLoadPlanner
from hybrid2d.config import CheckpointConfig, JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.mesh import agree, print0

# Test hook: "STEP:RANK" makes that rank SIGKILL itself in the save of STEP, after the data was
# written and before the checkpoint is published (the crash-safety test). Never set it otherwise.
KILL_IN_SAVE_ENV = "HYBRID2D_TEST_KILL_IN_SAVE"


class SaveError(ConfigError):
    """A checkpoint save failed on some rank; raised on every rank with the same one line."""


def _checked(fn, *args):
    """(result, None) or (None, the error's message). Any exception becomes the message, so no
    rank leaves the checks early while the others go on to the agreeing collective."""
    try:
        return fn(*args), None
    except ConfigError as e:
        return None, str(e)
    except Exception as e:
        return None, f"checking the checkpoint failed: {first_line(e)}"


# ---- which checkpoint to resume --------------------------------------------------------------


def find_resume(cfg: JobConfig, run_dir: str | os.PathLike) -> Path | None:
    """The step directory --checkpoint.resume asks for, checked against cfg.model (the model
    that runs: give the run's record, `RunLayout.recorded`, when init_from decides it) and its
    checksums; None to start fresh. Needs no model, and every rank runs it before data and model
    are built, so a bad checkpoint costs seconds."""
    setting = cfg.checkpoint.resume
    if not setting:
        # Training afresh beside another run's checkpoints would mix two runs in one
        # checkpoints/ (and move `latest` to the new one): refuse, naming both ways out.
        earlier, error = _checked(layout.latest_in_run, run_dir)
        if earlier is not None:
            error = (
                f"metrics.run_dir={run_dir} already holds checkpoints (latest {earlier.name}); "
                "continue that run with --checkpoint.resume auto, or train afresh in another "
                "--metrics.run_dir"
            )
        agree(error)
        return None

    def locate() -> Path | None:
        path = layout.latest_in_run(run_dir) if setting == "auto" else layout.resolve(setting)
        if path is not None:
            preflight(path, cfg)
            rank, world = (
                (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            )
            verify_files(path, rank, world)
        return path

    path, error = _checked(locate)
    agree(error)
    if path is None:
        print0(f"checkpoint.resume=auto: no checkpoint in {run_dir}, starting from step 0")
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, None if path is None else str(path.resolve()))
        if len(set(seen)) > 1:
            raise ConfigError(
                f"--checkpoint.resume={setting!r}: ranks see different checkpoints ({seen[0]} on "
                f"rank 0, {next(s for s in seen if s != seen[0])} elsewhere); checkpoints must be "
                "on a filesystem every rank shares"
            )
    return path


def preflight(path: Path, cfg: JobConfig) -> Metadata:
    """Checks of a training checkpoint that need no model: readable metadata, trainer state
    present, model tensors of the right names and shapes."""
    meta = read_metadata(path)
    if f"{TRAINER}.step" not in meta.state_dict_metadata:
        raise ConfigError(
            f"--checkpoint.resume: {path} holds no training state (a model-only checkpoint, e.g. "
            "converted from Hugging Face); start from it with --checkpoint.init_from dcp:PATH"
        )
    check_model_shapes(path, meta, run_model_shapes(cfg), cfg.model)
    check_same_base(path, cfg)  # LoRA: the adapters' base, which the checkpoint does not hold
    step = layout.step_of(path)
    if step is not None and step >= cfg.train.steps:
        raise ConfigError(_finished(path, step, cfg.train.steps))
    return meta


def _finished(path: Path, step: int, steps: int) -> str:
    return (
        f"checkpoint {path} is at step {step}, train.steps={steps}: nothing left to train; "
        f"raise --train.steps above {step}"
    )


# ---- the training state ----------------------------------------------------------------------


def _inside(state: dict, place: str) -> tuple[dict, str]:
    """(the dict that holds `place`, its last key): "trainer.data" -> (state["trainer"], "data")."""
    *parents, key = place.split(".")
    for name in parents:
        state = state.setdefault(name, {})
    return state, key


def _drop_unsaved_rng(state: dict, meta: Metadata) -> None:
    """A generator the checkpoint holds no state of (a CPU checkpoint resumed on CUDA has no
    cuda RNG) is left out of what is loaded: it keeps this launch's seeded state."""
    rng = state.get(TRAINER, {}).get("rng", {})
    for name in list(rng):
        if f"{TRAINER}.rng.{name}" not in meta.state_dict_metadata:
            del rng[name]


def _drop_unsaved_optional(state: dict, states: dict, meta: Metadata) -> None:
    """A key an object lists in `optional_state_keys` (one added to its state after checkpoints
    were written without it, e.g. the data loader's shuffle_block) is left out of what is loaded
    when the checkpoint lacks it: the object's load_state_dict sees it absent and decides."""
    for place, obj in states.items():
        for key in getattr(obj, "optional_state_keys", ()):
            holder, last = _inside(state, f"{place}.{key}")
            if f"{place}.{key}" not in meta.state_dict_metadata:
                holder.pop(last, None)


def _missing_or_mismatched(template: dict, meta: Metadata) -> str | None:
    """The first key of the state to load that the checkpoint lacks or has in another shape."""
    flat, _ = flatten_state_dict(template)
    saved = meta.state_dict_metadata
    for key, value in flat.items():
        if key not in saved:
            return f"it has no {key}"
        if isinstance(value, torch.Tensor):
            md = saved[key]
            if not isinstance(md, TensorStorageMetadata):
                return f"{key} is not a tensor there"
            if tuple(md.size) != tuple(value.shape):
                return f"{key} has shape {list(md.size)} there but {list(value.shape)} here"
    return None


# ---- the checkpointer ------------------------------------------------------------------------


def save_due(ck: CheckpointConfig, last: int, step: int) -> bool:
    """Whether `step` is saved: every `ck.every` steps, after the last step when
    `ck.save_final` (also with `every` set: `save_final false` means no final save), and at
    `ck.stop_after`."""
    return (
        (ck.every > 0 and step % ck.every == 0)
        or (step == last and ck.save_final)
        or step == ck.stop_after
    )


class Checkpointer:
    """Saves the state of `states` on schedule and restores it on resume (see the module doc).

    `states` maps a place in the saved dict to the object whose state goes there, dots nesting
    ("trainer.data" is the "data" entry of "trainer"'s dict). A place inside another comes after
    it; a load fills them in this order, so an object may rely on those before it being loaded.
    The "trainer" state holds the step (find_resume checks for it).
    """

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: str | os.PathLike,
        states: dict[str, Stateful],
        tokenizer=None,
        side_files: dict[str, str] | None = None,
    ):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.run_dir = Path(run_dir)
        self.states = dict(states)
        self.tokenizer_json = tokenizer.to_str() if tokenizer is not None else None
        # Small files every checkpoint carries (rank 0 writes them): the tokenizer's
        # (tokenizer_config.json, chat_template.jinja, ...) and the HF configs of the model
        # init_from leads to, so that an export finds its token ids after the source moved.
        self.side_files = dict(side_files or {})
        self.rank = dist.get_rank()
        if self.rank == 0 and self.ck.init_from:
            self.side_files |= source_files(self.ck.init_from, cfg.model, self.tokenizer_json)
        self.world = dist.get_world_size()
        self.saved: list[dict] = []  # per save: step, blocking_s, total_s, bytes
        self._pending: Future | None = None
        self._last_saved_step: int | None = None
        self._group = None
        self._executor = None
        if self.ck.async_save:
            # Background writes must not share a communicator with training's collectives.
            self._group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=cfg.parallel.timeout_s)
            )
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hybrid2d-ckpt")

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The nested dict DCP writes: each object's state_dict() at its place."""
        state: dict = {}
        for place, obj in self.states.items():
            holder, key = _inside(state, place)
            holder[key] = obj.state_dict()
        return state

    # -- saving --------------------------------------------------------------------------------

    def maybe_save(self, step: int) -> None:
        if save_due(self.ck, self.cfg.train.steps, step) and step != self._last_saved_step:
            self.save(step)

    def ensure_saved(self, step: int) -> None:
        """Save `step` unless that was just done (preemption: the state must be on disk)."""
        if step != self._last_saved_step:
            self.save(step)

    def save(self, step: int) -> None:
        """Write the state at `step`; returns once written (sync) or staged in memory (async)."""
        self.wait()
        start = time.perf_counter()
        tmp = layout.tmp_dir(self.run_dir, step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that never finished
            tmp.mkdir(parents=True)
            (tmp / layout.CONFIG).write_text(json.dumps(self.cfg.to_dict(), indent=2))
            if self.tokenizer_json is not None:
                (tmp / layout.TOKENIZER).write_text(self.tokenizer_json)
            for name, text in self.side_files.items():
                (tmp / name).write_text(text)
        dist.barrier()
        state = self.state_dict()
        self._last_saved_step = step
        if self._executor is None:
            self._publish(step, start, lambda: dcp.save(state, checkpoint_id=str(tmp)))
        else:
            written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            blocking = time.perf_counter() - start
            self._pending = self._executor.submit(
                self._publish, step, start, written.result, blocking
            )

    def _publish(self, step: int, start: float, write, blocking=None) -> None:
        """write() (this rank's DCP write, or waiting for it), hash a share of the files; then,
        if every rank got that far, rank 0 writes the checksums, renames step-N.tmp to step-N,
        updates `latest` and applies retention. SaveError on every rank if any rank failed."""
        mode = "sync" if blocking is None else "async"
        group = self._group
        tmp = layout.tmp_dir(self.run_dir, step)
        mine, error = None, None
        try:
            write()
            _maybe_kill_for_test(step, self.rank)
            names = integrity.checkpoint_files(tmp)
            mine = integrity.describe(tmp, integrity.share(names, self.rank, self.world))
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = self._failure(mode, step, tmp, e)
        everyone = self._exchange((mine, error), group)
        error = next((err for _, err in everyone if err), None)  # the same on every rank
        if error is None:
            if self.rank == 0:
                try:
                    entries = {k: v for part, _ in everyone for k, v in (part or {}).items()}
                    integrity.write(tmp, entries)
                    final = layout.publish(self.run_dir, step)
                    layout.apply_retention(self.run_dir, self.ck.keep_last)
                except Exception as e:
                    error = self._failure(mode, step, tmp, e, publishing=True)
            error = self._exchange(error, group)[0]  # rank 0's outcome, once it published
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never published: free the space
            raise SaveError(error)
        if self.rank == 0:
            total = time.perf_counter() - start
            size = sum(v["size"] for v in entries.values())
            self.saved.append(
                {
                    "step": step,
                    "blocking_s": total if blocking is None else blocking,
                    "total_s": total,
                    "bytes": size,
                }
            )
            print(f"checkpoint {final} ({size / 2**20:.1f} MiB, {mode}, {total:.2f} s)", flush=True)

    def _failure(
        self, mode: str, step: int, tmp: Path, e: BaseException, publishing: bool = False
    ) -> str:
        """The one line of a failed save: which rank, step, path and error."""
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: error}
        rank = min(failures) if isinstance(failures, dict) and failures else self.rank
        where = f"publishing {tmp}" if publishing else f"writing {tmp}; nothing was published"
        try:  # torch's writer reports a full disk as "unexpected pos 704 vs 598"
            free = shutil.disk_usage(tmp.parent).free
        except OSError:
            free = None
        if free is not None and free < _FULL_BYTES:
            where += f"; its filesystem has {free / 2**20:.1f} MiB free: full?"
        return f"rank {rank}: {mode} checkpoint save of step {step} failed: {cause(e)} ({where})"

    def _exchange(self, value, group) -> list:
        """Every rank's value (all_gather_object); a failed exchange (a peer died in its save)
        becomes this rank's error instead of an exception from the collective."""
        if self.world == 1:
            return [value]
        everyone = [None] * self.world
        try:
            dist.all_gather_object(everyone, value, group=group)
        except Exception as e:
            raise SaveError(
                f"rank {self.rank}: checkpoint save: the ranks could not agree on its outcome "
                f"({first_line(e)}); a peer failed or exited during the save"
            ) from None
        return everyone

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is published; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # -- resuming ------------------------------------------------------------------------------

    def load(self, path: Path) -> int:
        """Restore every object's state from `path`, in the order of `states`; returns the
        step. Any problem is one ConfigError on every rank, raised before dcp.load."""
        start = time.perf_counter()
        state = self.state_dict()  # the objects' current state: what dcp.load fills in place

        def check() -> None:
            meta = read_metadata(path)
            _drop_unsaved_rng(state, meta)
            _drop_unsaved_optional(state, self.states, meta)
            problem = _missing_or_mismatched(state, meta)
            if problem:
                saved = read_config(path)
                hint = ""
                if saved is not None and saved.train.optimizer != self.cfg.train.optimizer:
                    hint = (
                        f"; it was saved with train.optimizer={saved.train.optimizer!r}, resume "
                        f"with --train.optimizer {saved.train.optimizer}"
                    )
                raise ConfigError(f"checkpoint {path} does not fit this run: {problem}{hint}")
            saved_tokenizer = path / layout.TOKENIZER
            if (
                self.tokenizer_json is not None
                and saved_tokenizer.is_file()
                and saved_tokenizer.read_text() != self.tokenizer_json
            ):
                given = self.cfg.data.tokenizer or "'' (a BPE trained on data.path)"
                raise ConfigError(
                    f"checkpoint {path} was trained with another tokenizer than this launch's "
                    f"(data.tokenizer={given}): its token ids would stand for other text; resume "
                    "with the data settings it was trained with, or --data.tokenizer "
                    f"{path} (its tokenizer.json)"
                )

        _, error = _checked(check)
        agree(error)
        what = f"checkpoint {path} cannot be loaded"
        with as_config_error(what, "it is truncated or corrupted, use an earlier one"):
            # allow-listed metadata, non-tensor entries read with weights_only=True first
            dcp.load(state, storage_reader=MetadataReader(str(path)), planner=SafeLoadPlanner())
        for place, obj in self.states.items():
            holder, key = _inside(state, place)
            obj.load_state_dict(holder[key])
        step = int(state[TRAINER]["step"])
        self._last_saved_step = step
        if step >= self.cfg.train.steps:
            raise ConfigError(_finished(path, step, self.cfg.train.steps))
        print0(f"resumed from {path} at step {step} ({time.perf_counter() - start:.2f} s)")
        stop_after = self.cfg.checkpoint.stop_after
        if stop_after and stop_after <= step:
            print0(
                f"note: checkpoint.stop_after={stop_after} is not after the resumed step {step}, "
                f"so this run goes on to train.steps={self.cfg.train.steps}; give a later step "
                "to stop early again"
            )
        changed = changed_since(read_config(path), self.cfg)
        if changed:
            print0(f"resumed with settings changed since that checkpoint: {', '.join(changed)}")
        return step


# Free space below which a failed save's line says the filesystem may be full.
_FULL_BYTES = 64 << 20

# Settings a resume may change without changing what is learnt or from which data.
_FREE_ON_RESUME = {"train.steps", "train.micro_batch", "train.eval_every", "train.device"}


def changed_since(saved: JobConfig | None, now: JobConfig) -> list[str]:
    """'name old -> new' for each train.* / data.* setting that differs from the checkpoint's
    run (the data position carries over into other data or batches; allowed, but said)."""
    if saved is None:
        return []
    before, after = saved.to_dict(), now.to_dict()
    return [
        f"{section}.{key} {before[section][key]!r} -> {value!r}"
        for section in ("train", "data")
        for key, value in after[section].items()
        if f"{section}.{key}" not in _FREE_ON_RESUME
        and key != "cache_dir"
        and before[section].get(key) != value
    ]


def verify_files(path: Path, rank: int, world: int) -> None:
    """ConfigError if the checkpoint's files differ from its checksums.json (see integrity.py)."""
    problem = integrity.verify(path, rank, world)
    if problem:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}; resume from an earlier one")
    if not (path / layout.CHECKSUMS).is_file():  # every save writes one: deleted, or very old
        print0(
            f"note: checkpoint {path} has no {layout.CHECKSUMS}; its files are loaded unverified"
        )


def _maybe_kill_for_test(step: int, rank: int) -> None:
    spec = os.environ.get(KILL_IN_SAVE_ENV)
    if spec and spec == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
