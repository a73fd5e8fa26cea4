"""Small generated data sets in each layout, for demos and tests (no data-set hub here): each layout's
module writes its own (LAYOUT.write_tiny), drawing data.tiny_drawing's coloured shapes.
"""
from __future__ import annotations

from pathlib import Path

from kubetune_trainer.data.layouts import LAYOUTS

WRITERS = {name: layout.write_tiny for name, layout in LAYOUTS.items()}


def write_tiny_data(layout: str, out_dir: Path, count: int = 8, size: int = 64, seed: int = 0, **options) -> Path:
    """options: the layout writer's own (edit-pairs: references; video-captions: frames, fps)."""
    if layout not in WRITERS:
        raise ValueError(f"no tiny data for layout {layout!r}; available: {', '.join(WRITERS)}")
    return WRITERS[layout](out_dir, count=count, size=size, seed=seed, **options)
