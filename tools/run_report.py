"""The run report: each rank's step broken down over the run, and the load balance.

  python tools/run_report.py --run-dir runs/llama-debug-2026...   [--out page.html]

Reads RUN/balance.jsonl (per-rank compute, communication, data, optimizer and checkpoint time
of every logged step, the balance figures and the stragglers the run named) and, when the run
traced steps with --profile.trace_steps, RUN/traces/breakdown.json; writes one HTML page with
inline SVG charts (no scripts, opens offline) to RUN/run_report.html, beside the memory report
(RUN/memory/memory_report.html, tools/memory_report.py --run-dir), which it links to. Up to 16
ranks it draws a row per rank; beyond, a row per host with the median rank and the host's
fastest and slowest rank.
"""

from __future__ import annotations

import os
import sys

from hybrid2d.cli import OneLineParser
from hybrid2d.errors import ConfigError
from hybrid2d.profiling.run_report import write_run_report


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="a directory recipes/llama.py wrote")
    ap.add_argument("--out", help="the page's path (default RUN/run_report.html)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if not os.path.isdir(args.run_dir):
            raise ConfigError(
                f"--run-dir {args.run_dir} does not exist: give a run directory that "
                "recipes/llama.py wrote"
            )
        print(f"run report: {write_run_report(args.run_dir, args.out)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
