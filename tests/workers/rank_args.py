"""Worker: recipes/llama.py where the ranks from FROM on get more arguments, as when one node of
a job is launched with another command line.

usage: rank_args.py FROM "EXTRA ARGS" [recipes/llama.py arguments...]
"""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    start, extra, args = int(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
    if int(os.environ["RANK"]) >= start:
        args += extra  # given twice, a setting takes its last value
    sys.argv = [os.path.join(REPO, "recipes", "llama.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
