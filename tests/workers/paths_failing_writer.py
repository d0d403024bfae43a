"""Worker: the trainer's entry point with one rank's DCP write of one step failing.

usage: paths_failing_writer.py HOW STEP RANK [recipes/llama.py arguments...]
  HOW: raise (the write raises OSError, as a full disk would) or kill (the rank is SIGKILLed
       inside its write)
"""

import os
import re
import runpy
import signal
import sys

from torch.distributed.checkpoint import FileSystemWriter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    how, bad_step, bad_rank = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    write_data = FileSystemWriter.write_data

    def failing_write_data(self, plan, planner):
        step = int(re.search(r"step-(\d+)", str(self.path)).group(1))
        if step == bad_step and os.environ.get("RANK", "0") == bad_rank:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, f"injected write failure of step {step}")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing_write_data
    script = os.path.join(REPO, "recipes", "llama.py")
    sys.argv = [script, *sys.argv[4:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
