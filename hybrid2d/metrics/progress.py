"""Each step as rank 0 reports it: TensorBoard scalars, the progress bar (or a line per logged
step), the skipped-step and validation lines; and the losses, step times and validations the
summary is built from, so the bar and summary.json read the same figures."""

from __future__ import annotations

import sys

import torch.distributed as dist

from hybrid2d.config import JobConfig
from hybrid2d.data.tokenizer import describe_tokenizer
from hybrid2d.mesh import Mesh, describe_transport, print0
from hybrid2d.metrics.writer import MetricsWriter, peak_memory_bytes, step_flops


def start_line(cfg: JobConfig, mesh: Mesh, run_dir: str) -> str:
    """What a run is, in its first line: recipe, size, mesh, transport, tokenizer, run dir."""
    layout = mesh.layout
    return (
        f"hybrid2d: recipe {cfg.recipe}, {layout.model.num_params() / 1e6:.1f}M params, mesh "
        f"dp_replicate={mesh.dp_replicate} x dp_shard={mesh.dp_shard} x tp={mesh.tp} on "
        f"{mesh.device.type} ({describe_transport(mesh)}), tokenizer "
        f"{describe_tokenizer(cfg, layout)}, run dir {run_dir}"
    )


class _Bar:
    """A progress bar on rank 0's terminal."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def show(self, step: int, figures: dict, logged: bool) -> None:
        self._bar.set_postfix(figures)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


class _Lines:
    """Where stderr is no terminal (a log file, a batch system), a bar's carriage returns make
    one endless line: a plain line per logged step instead."""

    def __init__(self, total: int):
        self._total = total

    def show(self, step: int, figures: dict, logged: bool) -> None:
        if logged:
            shown = "  ".join(f"{k} {v}" for k, v in figures.items())
            print(f"step {step}/{self._total}  {shown}", flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> _Bar | _Lines | None:
    if not enabled or dist.get_rank() != 0:
        return None
    return _Bar(total) if sys.stderr.isatty() else _Lines(total)


class RunProgress:
    """Takes each step's result (a trainer StepResult) and each validation, in that order per
    step, then `show` once per step; every rank calls it, rank 0 alone prints and writes."""

    def __init__(self, cfg: JobConfig, mesh: Mesh, writer: MetricsWriter):
        self.steps = cfg.train.steps
        self.log_every = cfg.metrics.log_every
        self.device = mesh.device
        self.writer = writer
        self.bar = _progress(cfg.train.steps, cfg.metrics.progress_bar)
        self.positions_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.model = mesh.layout.model
        self.losses: list[float] = []
        self.times: list[float] = []  # seconds per step
        self.tokens: list[int] = []  # real (non-padding) tokens per step
        self.loss_tokens: list[int] = []  # loss tokens per step
        self.evals: list[dict] = []  # {step, loss, ppl} per validation

    def step(self, result, memory_scalars: dict[str, float]) -> None:
        """The step's figures: memory (--profile.memory) every step, the rest on logged steps."""
        self.writer.scalars(result.step, memory_scalars)
        if result.skipped:
            print0(f"step {result.step}: non-finite loss/grad norm, update skipped")
        self.losses.append(result.loss)
        self.times.append(result.seconds)
        self.tokens.append(result.tokens)
        self.loss_tokens.append(result.loss_tokens)
        if self._logged(result.step):
            # Real tokens, not padding: what a packed and a padded run are compared by.
            tps = result.tokens / result.seconds
            # Model FLOPs of the real tokens, attention over the pairs each document sees.
            flops = step_flops(self.model, result.tokens, result.attended)
            tflops_per_rank = flops / result.seconds / dist.get_world_size() / 1e12
            self.writer.scalars(
                result.step,
                {
                    "train/loss": result.loss,
                    "train/lr": result.lr,
                    "train/grad_norm": result.grad_norm,
                    "perf/tokens_per_s": tps,
                    "perf/loss_tokens_per_s": result.loss_tokens / result.seconds,
                    "perf/step_time_s": result.seconds,
                    "perf/tflops_per_rank": tflops_per_rank,
                    "memory/peak_gib": peak_memory_bytes(self.device) / 2**30,
                },
            )

    def validation(self, step: int, loss: float, ppl: float) -> None:
        self.evals.append({"step": step, "loss": loss, "ppl": ppl})
        self.writer.scalars(step, {"val/loss": loss, "val/ppl": ppl})
        if self.bar is None:
            print0(f"step {step}: val/loss {loss:.4f}, val/ppl {ppl:.2f}")

    def show(self, result) -> None:
        """The bar's figures; a line-mode bar shows only logged or validated steps, a terminal
        bar keeps the last validation's figures on every step."""
        if self.bar is None:
            return
        post = {
            "loss": f"{result.loss:.4f}",
            "lr": f"{result.lr:.2e}",
            "grad_norm": f"{result.grad_norm:.3f}",
            "tok_s": f"{result.tokens / result.seconds:,.0f}",
        }
        evaluated = bool(self.evals) and self.evals[-1]["step"] == result.step
        if self.evals and (evaluated or isinstance(self.bar, _Bar)):  # a line: only when it ran
            post["val_loss"] = f"{self.evals[-1]['loss']:.4f}"
            post["val_ppl"] = f"{self.evals[-1]['ppl']:.2f}"
        self.bar.show(result.step, post, self._logged(result.step) or evaluated)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()

    def _logged(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps
