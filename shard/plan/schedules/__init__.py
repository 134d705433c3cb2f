"""Pipeline schedules as data: per pipe rank, the ordered list of actions it runs.

One module per schedule (gpipe, one_f_one_b, interleaved, zb1p), each a ScheduleKind
(kind.py: its action lists, its stage -> rank placement, its facts), and one registry
(registry.py) that everything asking about schedules reads: the checker, its error messages,
`build`, explain, the planner and the executor. actions.py: the action kinds and what each
means; schedule.py: a built Schedule (communication, simulation, the drawing) and `build`.

Adding a schedule: its module, its line in registry.py, its tests. Pure data: no torch.
"""

from soapstone.shard.plan.schedules.actions import Action, ActionKind, Direction
from soapstone.shard.plan.schedules.kind import ScheduleError, ScheduleKind
from soapstone.shard.plan.schedules.registry import (
    CHUNKED,
    KINDS,
    SCHEDULES,
    SPLIT,
    equivalent_microbatches,
    get,
    theory_bubble,
)
from soapstone.shard.plan.schedules.schedule import Schedule, build

__all__ = ["CHUNKED", "KINDS", "SCHEDULES", "SPLIT", "Action", "ActionKind", "Direction",
           "Schedule", "ScheduleError", "ScheduleKind", "build", "equivalent_microbatches", "get",
           "theory_bubble"]
