"""Memory per rank of this run, measured (measure.py) and reported as Markdown/HTML (report.py)
beside the planner's estimate (planner/memory.py) and the one-process simulation of a large mesh
(simulate.py); profiler.py is the training loop's `--profile.memory` / `--profile.snapshot` hook.
The command line is tools/memory_report.py. traces.py is `--profile.trace_steps` (torch.profiler
traces and their per-rank breakdown); run_report.py the per-run HTML page of the ranks' step
breakdown and load balance (tools/run_report.py).
"""
