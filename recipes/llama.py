"""Train a Llama-family model on a (dp x tp) mesh.

accelerate launch --config_file recipes/accelerate/cpu_2x2.yaml recipes/llama.py
torchrun --nproc_per_node 4 recipes/llama.py --parallel.tp 2 --train.steps 50
python recipes/llama.py --list
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid2d import recipes  # noqa: E402
from hybrid2d.config import ConfigError, apply_overrides, describe  # noqa: E402


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(
        description="hybrid2d trainer: settings are --section.field value (see --help-config)",
        allow_abbrev=False,
    )
    parser.add_argument("--recipe", default="llama-debug", help="a name from --list")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="print every setting of the recipe with its value and exit",
    )
    args, rest = parser.parse_known_args(argv)
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        if args.list:
            print(recipes.table())
            return 0
        cfg = recipes.get(args.recipe)
        set_on_cli = apply_overrides(cfg, rest)
        if args.help_config:
            print(describe(cfg))
            return 0
        from hybrid2d.trainer import run

        run(cfg, set_on_cli)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as e:  # trainer.NonFiniteError: the message names the step
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
