"""What a run reports. `writer.py`: the figures (memory peaks, FLOPs per token) and TensorBoard;
`progress.py`: each step as rank 0 shows and logs it; `summary.py`: the run's summary.json and
its closing lines; `step_clock.py` and `balance.py`: each rank's step breakdown, gathered into
load balance and straggler figures. The figures are re-exported here: the profiler and the
planner read them."""

from hybrid2d.metrics.writer import (
    MetricsWriter,
    attended_keys,
    attended_pairs,
    device_peaks,
    flops_per_token,
    peak_memory_bytes,
    peak_rss_bytes,
    rss_bytes,
    step_flops,
)

__all__ = [
    "MetricsWriter",
    "attended_keys",
    "attended_pairs",
    "device_peaks",
    "flops_per_token",
    "peak_memory_bytes",
    "peak_rss_bytes",
    "rss_bytes",
    "step_flops",
]
