"""Memory per rank of this run, measured (measure.py) and reported as Markdown/HTML (report.py)
beside the planner's estimate (planner/memory.py) and the one-process simulation of a large mesh
(simulate.py); profiler.py is the training loop's `--profile.memory` / `--profile.snapshot` hook.
The command line is tools/memory_report.py.
"""
