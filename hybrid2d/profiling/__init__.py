"""Memory per rank: measured (measure.py), estimated (estimate.py), simulated on one process for
a large mesh (simulate.py), reported as Markdown/HTML (report.py); profiler.py is the training
loop's `--profile.memory` / `--profile.snapshot` hook. The command line is tools/memory_report.py.
"""
