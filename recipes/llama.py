"""Train a Llama-family model on a (dp x tp) mesh.

accelerate launch --config_file recipes/accelerate/cpu_2x2.yaml recipes/llama.py
torchrun --nproc_per_node 4 recipes/llama.py --parallel.tp 2 --train.steps 50
python recipes/llama.py --list
python recipes/llama.py --recipe llama3.1-8b --help
"""

from __future__ import annotations

import os
import sys
import time

from hybrid2d import recipes
from hybrid2d.cli import OneLineParser, apply_overrides, describe, print_help, run_and_exit
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import (
    PreemptedAtStartUp,
    check_before_torch,
    end_start_up,
    exit_with_launcher,
    stop_start_up_on_signals,
)

DESCRIPTION = (
    "hybrid2d trainer: a recipe's settings, changed with --section.field value. "
    "--recipe NAME picks the recipe (its values are the defaults below), --list lists the "
    "recipes, --help-config prints every setting's value."
)


def parse(argv: list[str]):
    """(--recipe / --list / --help-config / --help, the settings left for apply_overrides)."""
    parser = OneLineParser(
        add_help=False,
        allow_abbrev=False,
        hint="e.g. --recipe llama-debug (names: --list)",
        raise_config_error=True,  # main prints it, on rank 0 only
    )
    parser.add_argument("--recipe", default="llama-debug")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--help-config", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    exit_with_launcher()  # a kill -9 of the launcher must not leave this rank training
    stop_start_up_on_signals()  # SIGTERM before the first step: stop now (there is no step)
    try:
        args, rest = parse(sys.argv[1:] if argv is None else argv)
        if args.list:
            print(recipes.table())
            return 0
        cfg = recipes.get(args.recipe)
        if args.help:
            print_help(cfg, prog="recipes/llama.py", description=DESCRIPTION)
            return 0
        set_on_cli = apply_overrides(cfg, rest)
        if args.help_config:
            print(describe(cfg))
            return 0
        cfg.check_settings()
        check_before_torch(cfg, set_on_cli)
        from hybrid2d.mesh import CollectiveError  # torch: not for --list / --help
        from hybrid2d.trainer import run

        try:
            run(cfg, set_on_cli)
        except CollectiveError as e:  # a rank alone: every rank says what it saw
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 4
    except PreemptedAtStartUp as e:  # a preemption with nothing to save: as one, exit 0
        if rank == 0:
            print(e, flush=True)
        return 0
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one during it
        if rank == 0:
            print(
                "error: interrupted (Ctrl-C): nothing saved since the newest checkpoint "
                "(one Ctrl-C during training saves the step it is on)",
                file=sys.stderr,
                flush=True,
            )
        return 130
    except (ConfigError, FloatingPointError) as e:  # FloatingPointError: trainer.NonFiniteError
        if rank == 0:  # the message names the setting, or the step that was not finite
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank found the same error; give rank 0 the time to print it before
            # torchrun, seeing this rank exit first, stops rank 0 and the line is lost. The
            # launcher may stop this rank meanwhile (another rank exited first): that SIGTERM
            # is no start-up preemption, so start-up's handlers go first.
            end_start_up()
            time.sleep(2)
        return 2 if isinstance(e, ConfigError) else 3
    finally:
        end_start_up()
    return 0


if __name__ == "__main__":
    run_and_exit(main)
