"""The training loop, built from the pieces of the other modules (see DESIGN.md's data flow)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybrid2d.checkpoint.adapters import load_peft, read_peft
from hybrid2d.checkpoint.dcp import Checkpointer, find_resume
from hybrid2d.checkpoint.hf import describe_load, load_pretrained
from hybrid2d.checkpoint.reader import MODEL, OPTIMIZER, TRAINER
from hybrid2d.checkpoint.state import ModelState, OptimizerState, rng_state, set_rng_state
from hybrid2d.config import JobConfig
from hybrid2d.data import EvalSet, build_run_data
from hybrid2d.data.batch import Batch
from hybrid2d.data.chat import tokenizer_side_files
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import PreemptedAtStartUp, world_from_env
from hybrid2d.mesh import (
    Mesh,
    agree_on_settings,
    as_collective_error,
    build_mesh,
    init_distributed,
    on_rank0,
    pick_device,
    print0,
    set_cpu_threads,
    shutdown_distributed,
)
from hybrid2d.metrics import MetricsWriter, attended_pairs
from hybrid2d.metrics.balance import BalanceMonitor
from hybrid2d.metrics.progress import RunProgress, start_line
from hybrid2d.metrics.step_clock import StepClock, injected_delay
from hybrid2d.metrics.summary import run_summary, write_summary
from hybrid2d.models.llama import Llama
from hybrid2d.optim import build_optimizer, build_scheduler, clip_grad_norm, follow_settings
from hybrid2d.parallel import parallelize
from hybrid2d.parallel.lora import (
    describe_lora,
    init_adapters,
    replicated_adapters,
    sum_replicated_grads,
)
from hybrid2d.parallel.loss import cross_entropy, loss_tokens
from hybrid2d.planner.launch import check_planned_memory, describe_plan, planned, planner_profile
from hybrid2d.preemption import Preemption
from hybrid2d.profiling.profiler import MemoryProfiler
from hybrid2d.profiling.traces import StepTraces
from hybrid2d.resolve import resolve_layout
from hybrid2d.run_dir import create_run_dir, release_locks, write_run_config


def build_model(cfg: JobConfig, mesh: Mesh, resuming: bool = False) -> Llama:
    """Meta-device model -> TP -> AC -> compile -> FSDP -> materialise this rank's shards.
    Resuming, the parameters are left for the checkpoint to fill: neither init_from (on a large
    model, minutes of reading on every restart) nor a random init is done first."""
    peft = None  # checked before anything is built
    if cfg.lora.rank and cfg.lora.init_from and not resuming:
        peft = read_peft(cfg.lora.init_from, cfg.lora, mesh.layout.model)
    with torch.device("meta"):
        model = Llama(mesh.layout.model)
    parallelize(model, mesh, cfg.parallel, cfg.lora)
    if cfg.lora.rank:
        print0(describe_lora(model, cfg.lora))
    model.to_empty(device=mesh.device)
    model.tie_weights()
    if cfg.lora.rank:
        # A LoRA checkpoint holds the adapters only: the frozen base is read again on resume.
        _load_base(model, cfg)
        init_adapters(model, cfg.train.seed)
        if peft is not None:
            load_peft(model, peft)
    elif resuming:
        model.init_buffers()
        if cfg.checkpoint.init_from:
            print0(f"init_from {cfg.checkpoint.init_from}: not read, the resumed checkpoint has it")
    elif cfg.checkpoint.init_from:
        # hf:PATH / dcp:PATH: each rank reads its own shards; also recomputes the RoPE buffer.
        print0(describe_load(load_pretrained(model, cfg.checkpoint.init_from)))
    else:
        model.init_weights(cfg.train.seed)
    return model


def _load_base(model: Llama, cfg: JobConfig) -> None:
    """The frozen base of a LoRA run: init_from, or the seeded init without one."""
    if cfg.checkpoint.init_from:
        print0(describe_load(load_pretrained(model, cfg.checkpoint.init_from)))
    else:
        model.init_weights(cfg.train.seed)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    skipped: bool = False
    tokens: int = 0  # real (non-padding) positions of the global batch
    loss_tokens: int = 0  # positions of the global batch the loss counts
    # (query, key) pairs the global batch's attention masks let through, summed over layers
    # (documents of packed rows apart): the attention part of the step's model FLOPs
    attended: int = 0


class NonFiniteError(FloatingPointError):
    """The loss or the gradient norm became NaN or inf (the message names the step)."""


class Trainer:
    """Model, optimizer and schedule on a mesh; `train_step` runs one optimizer step."""

    def __init__(self, cfg: JobConfig, mesh: Mesh, resuming: bool = False):
        self.cfg = cfg
        self.mesh = mesh
        # The step's breakdown (metrics.balance); the loop begins and ends each step on it.
        self.clock = StepClock(mesh.device, cfg.metrics.balance)
        self.model = build_model(cfg, mesh, resuming)
        self.optimizer = build_optimizer(self.model, cfg.train)
        # LoRA adapters replicated over tp: their gradients are summed over tp once per step.
        self.replicated_adapters = replicated_adapters(self.model)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.step = 0
        self.skipped_steps: list[int] = []  # steps whose update was skipped (non-finite)

    def checkpoint_states(self) -> dict:
        """What a checkpoint holds of this trainer, by place, in the order a load needs: the
        optimizer's state before this trainer's own (load_state_dict sets its lr again)."""
        return {
            MODEL: ModelState(self.model, trainable_only=bool(self.cfg.lora.rank)),
            OPTIMIZER: OptimizerState(self.model, self.optimizer),
            TRAINER: self,
        }

    def state_dict(self) -> dict:
        """Progress: steps taken, the schedule's position and the random generators."""
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(self.mesh.device),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore progress once the optimizer's state is loaded. Its param groups then hold the
        saved run's lr, betas and weight decay; this launch's settings win over them."""
        self.scheduler.load_state_dict(state["scheduler"])
        follow_settings(self.optimizer, self.scheduler, self.cfg.train)
        set_rng_state(state["rng"], self.mesh.device)
        self.step = int(state["step"])

    def forward_backward(
        self, inputs, labels, scale: float, divide_by: float | None = None, documents=None
    ):
        """Summed token loss / divide_by (None: the mean over this batch's loss tokens),
        backward of it times scale; returns the loss. `documents`: packed rows' document index
        per position (None: each row one sequence)."""
        loss = cross_entropy(self.model(inputs, documents), labels, divide_by)
        (loss * scale).backward()
        return loss.detach()

    def global_counts(self, micro_batches: list[Batch], attended: int = 0) -> tuple[int, ...]:
        """(loss tokens, real tokens, attended pairs) of the whole global batch: labels other
        than -100, positions that are not padding in this rank's micro batches and this rank's
        `attended` (query, key) pairs, summed over the dp ranks (one all-reduce; tp ranks of a
        dp group agree)."""
        loss = sum(loss_tokens(b.labels) for b in micro_batches)
        real = sum(b.tokens for b in micro_batches)
        more = torch.tensor([real, attended], device=loss.device)
        counts = torch.cat([loss.reshape(1), more]).to(self.mesh.device)
        if self.mesh.dp > 1:
            dist.all_reduce(counts, group=self.mesh.dp_mesh.get_group())
        return tuple(int(x) for x in counts.tolist())

    def train_step(self, micro_batches: list) -> StepResult:
        """Forward/backward over this dp rank's micro batches (each a `Batch`, or an (inputs,
        labels) pair: rows of one sequence each), clip, step.

        The loss is normalised by the loss tokens of the whole global batch: each micro batch's
        summed token loss is divided by that global count N (labels -100 do not count), so the
        gradient is that of the mean over every loss token of the step whatever the dp size and
        micro batching, even when samples hold uneven numbers of loss tokens. FSDP's
        reduce-scatter averages gradients over the dp ranks (divides by dp), hence the backward
        of loss x dp. The reported loss is the global mean per loss token.
        """
        start = time.perf_counter()
        self.model.train()
        device = self.mesh.device
        n = len(micro_batches)
        phase = self.clock.phase
        # All of the step's batches go to the device here, where the GPU is idle anyway: a
        # blocking copy between micro batches would wait for the queued backward and take
        # away the host's run-ahead once per micro batch.
        with phase("data"):
            micro_batches = [Batch.of(b) for b in micro_batches]
            # Read from the host's copy of the document indices: no device sync.
            lengths = [n for b in micro_batches for n in b.document_lengths()]
            attended = attended_pairs(self.mesh.layout.model, lengths)
            micro_batches = [b.to(device) for b in micro_batches]
        with phase("comm"):
            total_tokens, real_tokens, attended = self.global_counts(micro_batches, attended)
        divide_by = float(max(total_tokens, 1))
        loss_sum = torch.zeros((), device=device)
        defer = self.cfg.parallel.defer_grad_sync and n > 1
        with phase("compute"):
            for i, b in enumerate(micro_batches):
                if defer:
                    last = i == n - 1
                    self.model.set_requires_gradient_sync(last)
                    self.model.set_requires_all_reduce(last)  # HSDP's all-reduce over replicas
                scale = float(self.mesh.dp)
                loss_sum += self.forward_backward(b.inputs, b.labels, scale, divide_by, b.documents)
        # LoRA's replicated adapter gradients summed over tp, the grad-norm reduction (its local
        # norms and the clipping multiply count with it) and the loss's: where every rank waits
        # for the slowest one's backward.
        with phase("comm"):
            sum_replicated_grads(self.replicated_adapters, self.mesh.tp_mesh)
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip).item()
            # Every rank sees the same global loss and norm, so all take the same branch.
            loss = self.dp_sum(loss_sum)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"step {self.step + 1}: loss {loss:.6g}, grad norm {grad_norm:.6g} is not finite; "
                "stopped before the update (no checkpoint holds this state); "
                "train.on_nonfinite=skip skips such steps instead"
            )
        self.step += 1
        with phase("optimizer"):
            if finite:
                self.optimizer.step()
            else:
                self.skipped_steps.append(self.step)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return StepResult(
            self.step, loss, grad_norm, lr, seconds, not finite, real_tokens, total_tokens,
            attended,
        )  # fmt: skip

    @torch.no_grad()
    def evaluate(self, val: EvalSet, on_batch: Callable[[], None] = lambda: None):
        """(mean loss per loss token, perplexity) over the whole held-out set: forward only,
        summed token losses and loss-token counts all-reduced over dp, so every mesh computes
        the same token-weighted mean. `on_batch` runs after each batch (progress)."""
        self.model.eval()
        device = self.mesh.device
        micro = self.mesh.layout.micro_batch
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in val.batches(self.mesh.dp_rank, self.mesh.dp, micro):
            inputs, labels, documents, _ = Batch.of(batch).to(device)
            totals[0] += cross_entropy(self.model(inputs, documents), labels, 1.0).double()
            totals[1] += loss_tokens(labels)
            on_batch()
        if self.mesh.dp > 1:
            dist.all_reduce(totals, group=self.mesh.dp_mesh.get_group())
        self.model.train()
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        return loss, math.exp(min(loss, 700.0))

    def dp_sum(self, value: torch.Tensor) -> float:
        """Sum over data-parallel ranks (tp ranks of a dp group already agree)."""
        if self.mesh.dp == 1:
            return value.item()
        value = value.detach().clone()
        dist.all_reduce(value, group=self.mesh.dp_mesh.get_group())
        return value.item()


# ---- the whole run --------------------------------------------------------------------------


def run(cfg: JobConfig, set_on_cli: frozenset[str] | set[str] = frozenset()) -> dict:
    """Resolve the layout, start the process group, train, summarise, shut down. Returns the
    summary. `set_on_cli`: the settings the command line gave (they win over the launcher's
    mesh sizes and init_from's model shape). cfg is read, never changed."""
    rank, world, _, per_node = world_from_env()
    injected_delay(rank)  # a malformed HYBRID2D_TEST_SLOW_RANK fails here, before any work
    device_type = pick_device(cfg.train.device)
    hw = planner_profile(cfg, device_type)
    layout, plan_line = resolve_layout(cfg, set_on_cli, world, per_node, hw)
    if device_type == "cpu":
        set_cpu_threads()
    init_distributed(device_type, cfg.parallel.timeout_s, cfg.parallel.shm_collectives)
    failed_alone = False
    stopped_at_start_up = False
    try:
        # Before any group is built, over the default one. data.cache_dir may be node-local.
        settings = cfg.to_dict()
        settings["data"].pop("cache_dir")
        agree_on_settings(settings, layout.settings())
        mesh = build_mesh(device_type, layout, cfg.parallel.timeout_s)
        if plan_line:
            print0(plan_line)
        plan = planned(cfg, mesh, hw, per_node)
        if cfg.parallel.check_memory:
            check_planned_memory(plan, mesh, per_node)  # the same verdict on every rank
        return _train(cfg, mesh, plan)
    except (ConfigError, FloatingPointError):
        raise  # raised on every rank together (mesh.agree, the same non-finite branch)
    except PreemptedAtStartUp:  # maybe on this rank alone: do not wait for the peers
        failed_alone = stopped_at_start_up = True
        raise
    except BaseException as e:
        failed_alone = True  # e.g. a collective timed out: the peers may never come
        failed = as_collective_error(e, cfg.parallel.timeout_s)
        if failed is None:
            raise
        raise failed from e
    finally:
        release_locks(discard_created=stopped_at_start_up)  # a relaunch finds no earlier run
        shutdown_distributed(wait_for_peers=not failed_alone)


def _train(cfg: JobConfig, mesh: Mesh, plan: dict) -> dict:
    torch.manual_seed(cfg.train.seed)
    run_dir = on_rank0(lambda: create_run_dir(cfg))  # rank 0 creates and locks it
    main = dist.get_rank() == 0
    layout = mesh.layout
    # What ran, as settings (the layout's values in place of the settings'): the run's and
    # its checkpoints' config.json, which a resume and an export read back.
    ran = JobConfig.from_dict(layout.recorded(cfg))
    print0(start_line(cfg, mesh, run_dir))
    print0(describe_plan(plan))
    # A bad --checkpoint.resume fails here, on every rank, before data and model are built.
    resume_from = find_resume(ran, run_dir)
    # Streaming reads over every rank (not only dp: a tp peer would read the same documents).
    readers = (dist.get_rank(), dist.get_world_size())
    data = build_run_data(
        cfg, layout, mesh.dp_rank, main, dist.barrier, _world_all_gather, readers=readers
    )
    print0(data.describe())
    trainer = Trainer(cfg, mesh, resuming=resume_from is not None)
    states = trainer.checkpoint_states() | {f"{TRAINER}.data": data.loader}
    side_files = tokenizer_side_files(data.tokenizer_dir)  # the chat template, ...
    ckpt = Checkpointer(ran, run_dir, states, data.tokenizer, side_files)
    if resume_from is not None:
        ckpt.load(resume_from)
    first_step = trainer.step + 1  # this launch's first step (after a resume: not 1)
    if main:
        write_run_config(run_dir, ran)
    writer = MetricsWriter(run_dir if main else None, cfg.metrics.tensorboard)
    # --profile.memory / --profile.snapshot
    memory = MemoryProfiler(cfg, mesh, trainer.model, trainer.optimizer, run_dir)
    traces = StepTraces(cfg.profile.trace_range(), run_dir)  # --profile.trace_steps
    # SIGTERM/SIGUSR1: save at this step and stop; a rank that does not get there within
    # timeout_s of its signal (hung) exits with one line instead.
    preemption = Preemption(mesh.device, cfg.parallel.timeout_s, lambda: trainer.step)
    progress = RunProgress(cfg, mesh, writer)
    balance = BalanceMonitor(cfg, mesh, trainer.clock, writer, run_dir)
    wall_start = time.perf_counter()
    try:
        stopped = _steps(cfg, trainer, data, ckpt, memory, traces, preemption, progress, balance)
    finally:
        preemption.close()
        data.close()  # streaming: its reader threads stop before the interpreter does
        ckpt.close()  # waits for an async save still being written
        memory.close()
        traces.close()
        progress.close()
    wall = time.perf_counter() - wall_start
    memory.write_report()
    traces.report()
    summary = run_summary(
        progress,
        mesh,
        plan,
        recipe=cfg.recipe,
        steps=trainer.step,
        first_step=first_step,
        time_s=wall,
        run_dir=run_dir,
        resumed_from=resume_from,
        checkpoints=ckpt.saved,
        preempted=preemption.stopping,  # a signal on any rank stopped the run
        data=data,
        tensor_peak=memory.tensor_peak(),
        stopped=stopped,
        skipped_steps=trainer.skipped_steps,
        balance=balance.summary(),
    )
    if main:
        write_summary(run_dir, summary)
    if stopped is not None:
        raise stopped
    return summary


def _world_all_gather(obj) -> list:
    """Every rank's obj in rank order (streaming's documents per round, read by every rank)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _steps(
    cfg, trainer, data, ckpt, memory, traces, preemption, progress, balance
) -> NonFiniteError | None:
    """Train until train.steps, checkpoint.stop_after or a signal (saved first). A non-finite
    step (every rank raises it together) is returned, to be raised after the summary."""
    clock = trainer.clock
    while trainer.step < cfg.train.steps:
        clock.begin_step()
        try:
            with traces.step(trainer.step + 1):
                with clock.phase("data"):
                    batch = data.loader.next_batch()
                with memory.step(trainer.step + 1):
                    result = trainer.train_step(batch)
        except NonFiniteError as e:
            return e
        progress.step(result, memory.scalars() | data.scalars())
        last = trainer.step in (cfg.train.steps, cfg.checkpoint.stop_after)
        every = cfg.train.eval_every
        if data.val is not None and ((every and result.step % every == 0) or last):
            progress.validation(result.step, *trainer.evaluate(data.val, preemption.progress))
        progress.show(result)
        preemption.progress()  # a save may follow: timeout_s for it, not since the signal
        with clock.phase("checkpoint"):
            ckpt.maybe_save(trainer.step)
        clock.end_step()
        balance.after_step(trainer.step)  # on logged steps: gathered, rank 0 writes
        if trainer.step == cfg.checkpoint.stop_after:
            break
        if preemption.requested():
            ckpt.ensure_saved(trainer.step)
            print0(
                f"{preemption.signal_name or 'a signal on another rank'}: saved a checkpoint "
                f"at step {trainer.step} and stopped; relaunch with --checkpoint.resume auto"
            )
            break
    return None


__all__ = ["Trainer", "build_model", "run", "ConfigError"]
