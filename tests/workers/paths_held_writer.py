"""Worker: the trainer's entry point whose DCP write of step HOLD (an async save) is held until
this rank's run has seen a stop request (SIGTERM / SIGUSR1 on any rank), so that the signal
arrives while that save is still being written.

usage: paths_held_writer.py HOLD [recipes/llama.py arguments...]

Prints "holding the write of step HOLD" when the hold begins. Should no stop request come
within 40 more steps, the write goes on and says "released without a stop request".
"""

import os
import re
import runpy
import sys
import threading

from torch.distributed.checkpoint import FileSystemWriter

from hybrid2d.preemption import Preemption
from hybrid2d.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    hold = int(sys.argv[1])
    changed = threading.Condition()
    state = {"stop": False, "trained": 0}

    requested = Preemption.requested

    def noted_requested(self):
        stop = requested(self)
        with changed:
            state["stop"] = state["stop"] or stop
            changed.notify_all()
        return stop

    train_step = Trainer.train_step

    def counted_train_step(self, micro_batches):
        result = train_step(self, micro_batches)
        with changed:
            state["trained"] = result.step
            changed.notify_all()
        return result

    write_data = FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        step = int(re.search(r"step-(\d+)", str(self.path)).group(1))
        if step == hold:
            print(f"holding the write of step {hold}", flush=True)
            with changed:
                changed.wait_for(lambda: state["stop"] or state["trained"] >= hold + 40)
                if not state["stop"]:
                    print("released without a stop request", flush=True)
        return write_data(self, plan, planner)

    Preemption.requested = noted_requested
    Trainer.train_step = counted_train_step
    FileSystemWriter.write_data = held_write_data
    script = os.path.join(REPO, "recipes", "llama.py")
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
