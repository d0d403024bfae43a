"""The run's summary: every rank's peak memory, this launch's losses and throughput, the plan's
prediction beside what was measured; written to summary.json and printed by rank 0."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from hybrid2d.data.run_data import RunData
from hybrid2d.mesh import Mesh
from hybrid2d.metrics.progress import RunProgress
from hybrid2d.metrics.writer import peak_memory_bytes


def gather_peaks(mesh: Mesh, tensor_peak: int | None) -> tuple[list[int], list[int | None]]:
    """Each rank's peak (the CUDA allocator's, else process RSS) and the peak of its tensors where
    one was measured (CUDA: the same; elsewhere --profile.memory's tracker), which the plan's
    tensor estimate can be compared with; RSS also counts the interpreter and libraries."""
    own = peak_memory_bytes(mesh.device)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (own, own if mesh.device.type == "cuda" else tensor_peak))
    return [peak for peak, _ in gathered], [tensors for _, tensors in gathered]


def against_plan(plan: dict, steady: list[float], tensor_peaks: list, on_cuda: bool) -> dict:
    """The plan with the measured step time and tensor peak beside its prediction."""
    if "error" in plan or not steady:
        return plan
    measured_step = sum(steady) / len(steady)
    plan = {
        **plan,
        "measured_step_s": measured_step,
        "step_error": plan["step_s"] / measured_step - 1,
    }
    if all(tensor_peaks):
        plan.update(
            measured_peak_bytes=max(tensor_peaks),
            peak_error=plan["peak_bytes"] / max(tensor_peaks) - 1,
            peak_measured_as="tensors, " + ("CUDA allocator" if on_cuda else "profile.memory"),
        )
    return plan


def throughput(progress: RunProgress, skip: int) -> dict:
    """tokens_per_s (real tokens), loss_tokens_per_s and positions_per_s over the steps after the
    first `skip`."""
    seconds = sum(progress.times[skip:])
    if not seconds:
        return {"tokens_per_s": 0.0, "loss_tokens_per_s": 0.0, "positions_per_s": 0.0}
    steps = len(progress.times) - skip
    return {
        "tokens_per_s": sum(progress.tokens[skip:]) / seconds,
        "loss_tokens_per_s": sum(progress.loss_tokens[skip:]) / seconds,
        "positions_per_s": progress.positions_per_step * steps / seconds,
    }


def run_summary(
    progress: RunProgress,
    mesh: Mesh,
    plan: dict,
    *,
    recipe: str,
    steps: int,
    first_step: int,
    time_s: float,
    run_dir: str,
    resumed_from: Path | None,
    checkpoints: list,
    preempted: bool,
    data: RunData,
    tensor_peak: int | None,
    stopped: BaseException | None,
    skipped_steps: list[int],
    balance: dict | None = None,
) -> dict:
    """summary.json's dict, built on every rank (each rank's peak is gathered from all).
    `skipped_steps`: this launch's steps whose update train.on_nonfinite=skip skipped."""
    peaks, tensor_peaks = gather_peaks(mesh, tensor_peak)
    losses, times, evals = progress.losses, progress.times, progress.evals
    # Skip the first steps (allocation, warm-up) when there are enough to measure steady state.
    steady = times[3:] if len(times) > 6 else times
    return {
        "recipe": recipe,
        "mesh": {"dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard, "tp": mesh.tp},
        "steps": steps,
        "first_step": first_step,  # losses[i] is step first_step + i: this launch's steps
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "losses": losses,
        "skipped_steps": skipped_steps,
        # real (non-padding) tokens and loss tokens per second over the steady steps; positions
        # (padding included: global_batch x seq_len per step) for the step time
        **throughput(progress, skip=len(times) - len(steady)),
        "time_s": time_s,
        "peak_memory_bytes_per_rank": peaks,
        "run_dir": run_dir,
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "checkpoints": checkpoints,
        "preempted": preempted,  # a signal on any rank stopped the run
        "data": data.summary(),
        "val": evals,
        "val_loss": evals[-1]["loss"] if evals else None,
        "val_ppl": evals[-1]["ppl"] if evals else None,
        "plan": against_plan(plan, steady, tensor_peaks, mesh.device.type == "cuda"),
        "stopped": None if stopped is None else str(stopped),
        "balance": balance,  # metrics/balance.py: per-rank breakdown, load balance, stragglers
    }


def write_summary(run_dir: str, summary: dict) -> None:
    """summary.json in the run dir and the closing lines on stdout (rank 0 calls it)."""
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(format_summary(summary), flush=True)


def _plan_line(p: dict) -> str:
    if "peak_error" in p:
        memory = (
            f"against {p['measured_peak_bytes'] / 2**30:.3g} measured ({p['peak_error']:+.0%}, "
            f"{p['peak_measured_as']})"
        )
    else:
        memory = "(tensors not measured: --profile.memory measures them off CUDA)"
    return (
        f"  planned        {p['step_s']:.3g} s/step against {p['measured_step_s']:.3g} measured "
        f"({p['step_error']:+.0%}{', uncalibrated' if p.get('guess') else ''}), "
        f"{p['peak_bytes'] / 2**30:.3g} GiB/rank {memory}"
    )


def _step_ranges(steps: list[int], shown: int = 6) -> str:
    """Ascending steps as ranges (`1-3, 7`); past `shown` ranges, the first and last ones
    around `...`, so a long run's line stays one short line."""
    ranges: list[list[int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
    if len(text) > shown:
        text = [*text[: shown - 2], "...", *text[-2:]]
    return ", ".join(text)


def _balance_lines(b: dict) -> list[str]:
    """The step's parts on the slowest rank and the median, load balance, stragglers named."""
    ranks = b["ranks"]
    slow = ranks[b["slowest_rank"]]
    coords = ",".join(str(i) for i in b["slowest_coords"])

    def parts(r: dict) -> str:
        shown = ("compute", "comm", "data", "optimizer", "checkpoint", "other")
        return " ".join(f"{p} {r[p + '_s'] / max(r['step_s'], 1e-12):.0%}" for p in shown)

    named = ", ".join(
        f"rank {s['rank']} +{s['excess']:.0%} at step {s['step']}" for s in b["stragglers"]
    )
    return [
        f"  balance        compute max/median {b['compute_max_over_median']:.2f} (worst "
        f"{b['worst_compute_max_over_median']:.2f}), slowest rank {b['slowest_rank']} on "
        f"{b['slowest_host']} at mesh [{coords}]; stragglers: {named or 'none'}",
        f"  step parts     slowest rank: {parts(slow)}",
    ]


def format_summary(s: dict) -> str:
    lines = ["summary", f"  steps          {s['steps']}"]
    if s["losses"]:
        lines.append(f"  loss           {s['first_loss']:.4f} -> {s['last_loss']:.4f}")
    if skipped := s.get("skipped_steps"):
        updates = s["steps"] - s["first_step"] + 1
        lines.append(
            f"  skipped        {len(skipped)} of {updates} updates (non-finite): "
            f"steps {_step_ranges(skipped)}"
        )
    if s.get("val_loss") is not None:
        lines.append(f"  val loss       {s['val_loss']:.4f} (perplexity {s['val_ppl']:.2f})")
    if train := s.get("data", {}).get("train"):
        lines.append(
            f"  truncated      {train['truncated']} samples "
            f"({train['dropped']} dropped: no loss token within seq_len)"
        )
    if packing := s.get("data", {}).get("packing"):
        lines.append(
            f"  packed         {packing['samples']} samples in {packing['rows']} rows "
            f"({packing['samples_per_row']:.2f} per row), padding "
            f"{packing['padding_fraction']:.0%}, packing efficiency "
            f"{packing['packing_efficiency']:.0%}"
        )
    lines.append(
        f"  tokens/s       {s['tokens_per_s']:,.0f} (real tokens, no padding), loss tokens/s "
        f"{s.get('loss_tokens_per_s', 0.0):,.0f}"
    )
    if "step_error" in s.get("plan", {}):
        lines.append(_plan_line(s["plan"]))
    if s.get("balance"):
        lines += _balance_lines(s["balance"])
    peaks = ", ".join(f"{b / 2**20:.0f}" for b in s["peak_memory_bytes_per_rank"])
    lines += [
        f"  time           {s['time_s']:.1f} s",
        f"  peak MiB/rank  {peaks}",
        f"  run dir        {s['run_dir']}",
    ]
    return "\n".join(lines)
