"""Worker: a short training run through hybrid2d.trainer.run, with an async checkpoint (its own
gloo group); prints this process's thread count before and after as JSON.

usage: threads_after_run.py RUN_DIR CACHE_DIR DP_SHARD TP
"""

import json
import os
import sys

# The tokenizer's Rust thread pool (rank 0 builds the data cache) lives until exit by design
# and never touches Python; without it every thread left after run() is a leak to look at.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from hybrid2d import recipes  # noqa: E402
from hybrid2d.cli import apply_overrides  # noqa: E402
from hybrid2d.trainer import run  # noqa: E402
from tests.test_faults import SMALL  # noqa: E402


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main():
    run_dir, cache_dir, dp_shard, tp = sys.argv[1:5]
    cfg = recipes.get("llama-debug")
    settings = [*SMALL, "--parallel.dp_shard", dp_shard, "--parallel.tp", tp]
    settings += ["--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.async_save", "true"]
    settings += ["--metrics.run_dir", run_dir, "--data.cache_dir", cache_dir]
    set_on_cli = apply_overrides(cfg, settings)
    before = threads()
    run(cfg, set_on_cli)
    print(json.dumps({"before": before, "after": threads()}), flush=True)


if __name__ == "__main__":
    main()
