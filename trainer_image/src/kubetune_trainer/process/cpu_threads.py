"""CPU threads per trainer process, when nobody set OMP_NUM_THREADS.

torch starts one intra-op thread per core it sees, and a container sees every core of its node.
Several such processes on one machine (a pod's sibling trainers, other pods' trainers) then
oversubscribe the cores, and OpenMP threads spend their time waiting on one another: on a 2-core
machine beside one other busy process, 60 tiny SD1.5 steps took 320 s with torch's default and
8.4 s with one thread. So a pod's processes share what the pod was given: the least of its CPU
request (what the scheduler set aside for it), its limit and the cores it sees, split evenly,
at least one thread each. The operator passes the request and limit through the downward API.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

from kubetune_api.contract import CPU_LIMIT_MILLICORES, CPU_REQUEST_MILLICORES


def _cores(env: Mapping[str, str], name: str) -> float | None:
    """A millicore count from the environment as cores; None when absent, unreadable or 0
    (the downward API's value of a request that was never set)."""
    try:
        millicores = int(env.get(name, ""))
    except ValueError:
        return None
    return millicores / 1000 if millicores > 0 else None


def cpu_allowance(env: Mapping[str, str], visible_cores: int) -> float:
    """The cores this pod may count on. An unset limit reads as the node's allocatable CPU through
    the downward API, so the least of what is known is the answer, never the first found."""
    known = (_cores(env, CPU_REQUEST_MILLICORES), _cores(env, CPU_LIMIT_MILLICORES), float(visible_cores))
    return min(cores for cores in known if cores is not None)


def threads_per_process(allowance: float, processes: int) -> int:
    return max(1, math.floor(allowance / processes))


def thread_env(env: Mapping[str, str], processes: int, visible_cores: int | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for each of this pod's `processes` trainers; nothing when the user set it."""
    if env.get("OMP_NUM_THREADS"):
        return {}
    visible = visible_cores if visible_cores is not None else len(os.sched_getaffinity(0))
    return {"OMP_NUM_THREADS": str(threads_per_process(cpu_allowance(env, visible), processes))}
