"""Worker: the trainer's entry point with every DCP file write held back until training has
gone past the step being written (an event, not a time).

usage: ckpt_slow_writer.py LOG [recipes/llama.py arguments...]

With async_save this proves the point of it: the training loop goes on while a checkpoint is
still being written, and the tensors written are those of the step that was saved, not of the
steps that ran during the write (the state is copied before the call returns). Each write
appends "rank step steps_trained" to LOG as it starts writing: steps_trained > step shows that
training went on during the write. A write of the last step (nothing trains after it), or one
that waited WAIT_S without training going on (a save that blocks training), goes ahead
at once, and its line says so.
"""

import os
import re
import runpy
import sys
import threading

from torch.distributed.checkpoint import FileSystemWriter

from hybrid2d.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 120  # only a broken async save waits this long; the test then fails on the log


def main():
    log = sys.argv[1]
    args = sys.argv[2:]
    last = int(args[args.index("--train.steps") + 1])
    trained = [0]
    changed = threading.Condition()
    train_step = Trainer.train_step

    def counted_train_step(self, micro_batches):
        result = train_step(self, micro_batches)
        with changed:
            trained[0] = result.step
            changed.notify_all()
        return result

    write_data = FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        step = int(re.search(r"step-(\d+)", str(self.path)).group(1))
        if step < last:
            with changed:
                changed.wait_for(lambda: trained[0] > step, timeout=WAIT_S)
        with open(log, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {step} {trained[0]}\n")
        return write_data(self, plan, planner)

    Trainer.train_step = counted_train_step
    FileSystemWriter.write_data = held_write_data
    script = os.path.join(REPO, "recipes", "llama.py")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
