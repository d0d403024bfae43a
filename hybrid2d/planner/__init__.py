"""Choose the mesh: predicted step time and memory of every configuration of a job on a cluster.

The planner owns every prediction: `memory.py` the memory of one rank, `comm.py` the
collectives of one step, `model.py` the step time, which prices those two and metrics' FLOPs on
`hardware.py`'s device profiles (vendor figures with their sources, achieved fractions as stated
assumptions or calibrated measurements); `search.py` enumerates and ranks the candidates,
`calibrate.py` measures a machine. What a run measures is `profiling/`'s and `comm_report.py`'s.
The command line is tools/plan.py; docs/planner.md has the model and its validation.

    from hybrid2d.planner import best_plan, predict, hardware
    best = best_plan(cfg, world_size=64, gpus_per_node=8, hardware=hardware.get("h100"))
"""

from hybrid2d.planner import hardware
from hybrid2d.planner.hardware import Hardware, Link
from hybrid2d.planner.model import Candidate, predict
from hybrid2d.planner.search import Plan, Rejected, best_plan, plan

__all__ = [
    "Candidate",
    "Hardware",
    "Link",
    "Plan",
    "Rejected",
    "best_plan",
    "hardware",
    "plan",
    "predict",
]
