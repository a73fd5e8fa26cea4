"""The scalars a run logged to TensorBoard (telemetry/reporting.py: train/loss, train/lr, train/samples_per_second;
validation.py: validation/<metric>), read back from the event files under its logs/ folder.

A run writes several event files: the reporter and the validator each hold a writer, and a resumed run
opens new ones. Each file is read on its own (TensorBoard's accumulator, told not to purge: across two
writers a smaller step is no restart), then merged per tag and step; where a step appears twice (a run
resumed from an earlier checkpoint logs the steps after it again), the later write wins, since the
final weights descend from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

EVENT_FILE_MARK = "tfevents"


@dataclass(frozen=True)
class Point:
    step: int
    wall_time: float  # seconds since the epoch, when it was logged
    value: float


@dataclass
class Scalars:
    series: dict[str, list[Point]] = field(default_factory=dict)  # by tag, in step order
    files: int = 0  # event files read

    def get(self, tag: str) -> list[Point]:
        return self.series.get(tag, [])

    def under(self, prefix: str) -> dict[str, list[Point]]:
        """The series whose tag starts with PREFIX ("validation/"), by the rest of the tag."""
        return {tag[len(prefix):]: points for tag, points in sorted(self.series.items()) if tag.startswith(prefix)}


def event_files(logs: Path) -> list[Path]:
    return sorted(p for p in logs.rglob(f"*{EVENT_FILE_MARK}*") if p.is_file()) if logs.is_dir() else []


def read_scalars(logs: Path) -> Scalars:
    """Every scalar under LOGS (an empty Scalars where there is no such folder or no event file)."""
    from tensorboard.backend.event_processing.event_accumulator import (IMAGES, SCALARS, TENSORS,
                                                                         EventAccumulator)

    latest: dict[str, dict[int, Point]] = {}
    files = event_files(logs)
    for path in files:
        # 0 keeps every scalar; images and tensors are not needed (the grids are read from samples/).
        accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0, IMAGES: 1, TENSORS: 1},
                                       purge_orphaned_data=False)
        accumulator.Reload()
        for tag in accumulator.Tags()[SCALARS]:
            by_step = latest.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                seen = by_step.get(event.step)
                if seen is None or event.wall_time >= seen.wall_time:
                    by_step[event.step] = Point(event.step, event.wall_time, event.value)
    return Scalars({tag: [by_step[s] for s in sorted(by_step)] for tag, by_step in latest.items()}, len(files))
