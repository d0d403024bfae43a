"""Worker: the trainer's entry point where rank HUNG_RANK stops answering before step STEP
(it sleeps, alive, in no collective), as a rank stuck in I/O or a deadlock would.

usage: paths_hung_peer.py STEP HUNG_RANK [recipes/llama.py arguments...]
"""

import os
import runpy
import sys
import threading

from hybrid2d.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    hang_step, hung_rank = int(sys.argv[1]), sys.argv[2]
    train_step = Trainer.train_step

    def maybe_hang(self, micro_batches):
        if self.step + 1 == hang_step and os.environ.get("RANK") == hung_rank:
            print(f"rank {hung_rank} hangs before step {hang_step}", flush=True)
            threading.Event().wait()  # forever: the launcher ends this process
        return train_step(self, micro_batches)

    Trainer.train_step = maybe_hang
    script = os.path.join(REPO, "recipes", "llama.py")
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
