"""Pod on the node → first training step, from a dev cluster's kubelet state after a run (issue 41).

    python benchmarks/pod_start.py KUBELET_STATE   # e.g. /tmp/pytest-of-root/pytest-N/devcluster0/kubelet

For every trainer pod that logged a training step: from the moment the dev kubelet made the pod's directory
(it took the pod, already bound to its node: scheduling is not counted) to the trainer's first `step N/`
line. That covers the container's start, the trainer's imports, the model and data fetched (from S3 in the
e2e jobs) and the first step itself. Pods whose log says `resumed from` add a checkpoint's load (the path
after a preemption). Printed: count, median, min and max seconds of each kind.
"""
from __future__ import annotations

import datetime
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO kubetune\.trainer: step \d+/")


def born(path: Path) -> float:
    """The directory's creation time (statx birth time; its change time where the file system has none)."""
    birth = float(subprocess.run(["stat", "-c", "%W", str(path)], capture_output=True, text=True, check=True).stdout)
    return birth if birth > 0 else os.stat(path).st_ctime


def first_step_after_start(pod: Path) -> tuple[str, float] | None:
    for log in sorted((pod / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        found = STEP.search(text)
        if found:
            logged = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
            seconds = logged.replace(tzinfo=datetime.timezone.utc).timestamp() - born(pod)
            return ("resumed" if "resumed from" in text else "fresh"), seconds
    return None


def main(state: Path) -> None:
    kinds: dict[str, list[float]] = {"fresh": [], "resumed": []}
    for pod in sorted((state / "pods").iterdir()):
        found = first_step_after_start(pod)
        if found:
            kinds[found[0]].append(found[1])
    print("| pods | count | median s | min s | max s |\n|---|---|---|---|---|")
    for kind, seconds in kinds.items():
        if seconds:
            print(f"| {kind} | {len(seconds)} | {statistics.median(seconds):.1f} | {min(seconds):.1f} | "
                  f"{max(seconds):.1f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
