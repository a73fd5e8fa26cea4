"""The report's curves, drawn with matplotlib off-screen into PNG bytes.

Figures are built from matplotlib.figure.Figure directly, not pyplot: no global figure state and no
GUI backend, so drawing works in a trainer pod and beside another thread's work.
"""
from __future__ import annotations

import io

from kubetune_trainer.results.run_report.events import Point

WIDTH_INCHES = 10.0
DPI = 100
SMOOTHING = 0.9  # TensorBoard's default weight, for short runs: a loss curve of single steps is mostly noise
SMOOTHED_STEPS = 50  # longer runs average over about 1/50 of their steps (10,000 steps: weight 0.995)
LOSS_COLOUR, LR_COLOUR, METRIC_COLOUR = "#1f77b4", "#d62728", "#2ca02c"


def smoothing_for(count: int) -> float:
    return max(SMOOTHING, 1 - SMOOTHED_STEPS / count) if count else SMOOTHING


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """An exponential moving average, debiased like TensorBoard's so that it starts at the first values."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = average * weight + (1 - weight) * value
        out.append(average / (1 - weight ** i))
    return out


def integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def training_curves(loss: list[Point], lr: list[Point]) -> bytes:
    """Loss (each step faint, smoothed on top) above the learning rate, on one step axis."""
    from matplotlib.figure import Figure

    rows = [series for series in (loss, lr) if series]
    figure = Figure(figsize=(WIDTH_INCHES, 3.0 * len(rows)), layout="constrained")
    axes = figure.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    panel = iter(axes)
    if loss:
        ax = next(panel)
        steps, values = [p.step for p in loss], [p.value for p in loss]
        ax.plot(steps, values, color=LOSS_COLOUR, alpha=0.3, linewidth=0.8, label="loss (each step)")
        if len(values) > 1:
            weight = smoothing_for(len(values))
            ax.plot(steps, smoothed(values, weight), color=LOSS_COLOUR, linewidth=1.6, label=f"smoothed ({weight:.3g})")
        ax.set_ylabel("training loss")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    if lr:
        ax = next(panel)
        ax.plot([p.step for p in lr], [p.value for p in lr], color=LR_COLOUR, linewidth=1.4)
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    integer_steps(axes[-1])
    return _png(figure)


def validation_curves(metrics: dict[str, list[Point]]) -> bytes:
    """One small panel per validation metric over the steps it was measured at."""
    from matplotlib.figure import Figure

    columns = min(3, len(metrics))
    rows = -(-len(metrics) // columns)
    figure = Figure(figsize=(WIDTH_INCHES, 2.8 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (name, points) in zip(axes, metrics.items()):
        ax.plot([p.step for p in points], [p.value for p in points], color=METRIC_COLOUR, marker="o",
                markersize=3, linewidth=1.4)
        ax.set_title(name)
        ax.set_xlabel("step")
        integer_steps(ax)
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    return _png(figure)
