"""Worker: the trainer's entry point with every DCP file write delayed by DELAY seconds.

usage: ckpt_slow_writer.py DELAY [recipes/llama.py arguments...]

With async_save this proves the point of it: the training loop goes on while a checkpoint is
still being written, and the tensors written are those of the step that was saved, not of the
steps that ran during the write (the state is copied before the call returns).
"""

import os
import runpy
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    delay = float(sys.argv[1])
    write_data = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(delay)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = slow_write_data
    script = os.path.join(REPO, "recipes", "llama.py")
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
