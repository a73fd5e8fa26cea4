"""The report as one self-contained HTML page: every picture is embedded as a data: URI.

One file, because the report travels: it is written into the run's directory in S3 and opened from
there (a presigned URL, the bucket's console, a download), mailed, attached to a ticket. Pictures in a
folder beside it would need every one of them fetched with it, and relative links do not resolve
from an S3 object's URL. Grids wider than MAX_GRID_WIDTH are embedded scaled down as JPEG (50
validations of a 4-image 512 px grid, ~2 MB each as PNG, would otherwise make a page of over 100 MB); the caption names the
full-size grid in the run. Nothing runs in the page: no script, no external fetch.
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kubetune_api import layout
from kubetune_trainer.results.run_report import charts
from kubetune_trainer.results.run_report.facts import Grid, RunFacts
from kubetune_trainer.checkpoint.catalog import human_size

MAX_GRID_WIDTH = 1280
MIN_GRID_WIDTH = 512
JPEG_QUALITY = 85

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: 0.5rem 0; } td, th { padding: 0.2rem 0.8rem; text-align: left; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; height: auto; } img.enlarged { image-rendering: pixelated; } figure { margin: 1rem 0; } figcaption { color: #555; font-size: 0.9rem; }
pre { background: #f6f6f6; padding: 0.8rem; overflow-x: auto; font-size: 0.85rem; }
.missing { background: #fff6e0; border-left: 4px solid #e0a000; padding: 0.5rem 1rem; }
code { font-size: 0.9rem; } .uri { word-break: break-all; }
"""


def e(value) -> str:
    return html.escape(str(value), quote=True)


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


@dataclass(frozen=True)
class Picture:
    source: str  # a data: URI
    width: int  # to show it at
    enlarged: bool  # shown wider than it is: drawn with sharp pixels


def embedded_grid(path: Path) -> Picture:
    """The grid as it is when small, else scaled to MAX_GRID_WIDTH as JPEG; a tiny model's 32 px samples
    are shown enlarged to MIN_GRID_WIDTH so that they can be seen."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # a damaged file fails here, not in the browser
        if image.width <= MAX_GRID_WIDTH:
            return Picture(data_uri(path.read_bytes(), "image/png"), max(image.width, MIN_GRID_WIDTH),
                           image.width < MIN_GRID_WIDTH)
        height = max(1, round(image.height * MAX_GRID_WIDTH / image.width))
        buffer = io.BytesIO()
        image.convert("RGB").resize((MAX_GRID_WIDTH, height), Image.Resampling.LANCZOS).save(
            buffer, format="JPEG", quality=JPEG_QUALITY)
        return Picture(data_uri(buffer.getvalue(), "image/jpeg"), MAX_GRID_WIDTH, False)


def embedded_grids(grids: list[Grid]) -> list[Picture | OSError]:
    """embedded_grid of each, or the error that made one unreadable; on threads, since decoding, scaling and
    encoding release the GIL (50 grids of a long run are most of the page's time)."""
    def one(grid: Grid) -> Picture | OSError:
        try:
            return embedded_grid(grid.path)
        except OSError as err:
            return err

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, grids))


def when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {secs:02d} s" if hours else f"{minutes} min {secs:02d} s"


def table(header: list[str] | None, rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f'<td{" class=number" if i in numeric else ""}>{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def step_label(step: int) -> str:
    return "base" if step == 0 else f"step {step}"


def overview(facts: RunFacts) -> str:
    run = facts.run
    state = "finished" if run.record.finished else f"not finished ({run.record.steps} steps recorded)"
    rows = [["run", f'<span class="uri">{e(run.uri)}</span>'],
            ["version", e(layout.version_name(run.version)) if run.version is not None else "-"],
            ["state", e(state)]]
    timing = facts.timing
    if timing is not None:
        rows += [["steps logged", e(f"{timing.first_step} to {timing.last_step} ({len(facts.loss)} steps)")],
                 ["first logged step", e(when(timing.started))], ["last logged step", e(when(timing.ended))],
                 ["training time (first to last logged step)", e(duration(timing.seconds))]]
        if timing.steps_per_second:
            rows.append(["throughput", e(f"{timing.steps_per_second:.3f} steps/s, "
                                         f"{timing.seconds / max(1, timing.last_step - timing.first_step):.3f} s/step")])
        if timing.samples_per_second:
            rows.append(["samples per second (median of the steps)", e(f"{timing.samples_per_second:.2f}")])
        rows.append(["last training loss", e(f"{facts.loss[-1].value:.5f}")])
    return "<h2>Run</h2>" + table(None, [[f"<b>{e(label)}</b>", value] for label, value in rows])


def curves(facts: RunFacts) -> str:
    if not facts.loss and not facts.lr:
        return "<h2>Training curves</h2><p>No loss or learning rate was logged.</p>"
    picture = data_uri(charts.training_curves(facts.loss, facts.lr), "image/png")
    return ('<h2>Training curves</h2><figure><img class="curve" id="training-curves" '
            f'alt="training loss and learning rate over steps" src="{picture}"></figure>')


def validation_metrics(facts: RunFacts) -> str:
    metrics = facts.validation
    if not metrics:
        return "<h2>Validation metrics</h2><p>No validation metrics were logged (they need held-out data or " \
               "spec.validation.clipModel).</p>"
    picture = data_uri(charts.validation_curves(metrics), "image/png")
    steps = sorted({p.step for points in metrics.values() for p in points})
    values = {name: {p.step: p.value for p in points} for name, points in metrics.items()}
    rows = [[e(step_label(step))] + [e(f"{values[name][step]:.5g}") if step in values[name] else "-"
                                     for name in metrics] for step in steps]
    return ('<h2>Validation metrics</h2><figure><img class="curve" id="validation-curves" '
            f'alt="validation metrics over steps" src="{picture}"></figure>'
            + table(["step", *metrics], rows, numeric=set(range(1, len(metrics) + 1))))


def grids(facts: RunFacts) -> str:
    if not facts.grids:
        return "<h2>Validation grids</h2><p>No validation grids.</p>"
    prompts = ""
    if facts.prompts:
        items = "".join(f"<li>{e(p)}</li>" for p in facts.prompts)
        prompts = f"<p>The same prompts and seed at every step, in reading order:</p><ol>{items}</ol>"
    figures = []
    for grid, picture in zip(facts.grids, embedded_grids(facts.grids)):
        if isinstance(picture, OSError):  # a damaged image: say so, never a broken picture
            facts.missing.append(f"{grid.name} could not be read ({picture})")
            continue
        figures.append(f'<figure><img class="grid{" enlarged" if picture.enlarged else ""}" '
                       f'alt="validation samples at {e(step_label(grid.step))}" width="{picture.width}" '
                       f'src="{picture.source}"><figcaption><b>{e(step_label(grid.step))}</b> · '
                       f'<code>{e(grid.name)}</code></figcaption></figure>')
    return f"<h2>Validation grids</h2>{prompts}{''.join(figures)}"


def weights(facts: RunFacts) -> str:
    run = facts.run
    parts = ["<h2>Weights</h2>"]
    if run.final_files:
        rows = [[f"<code>{e(name)}</code>", e(human_size(count)), f'<span class="uri">{e(layout.join(run.uri, name))}</span>']
                for name, count in sorted(run.final_files.items())]
        parts.append("<h3>Final weights</h3>" + table(["file", "size", "URI"], rows, numeric={1}))
    else:
        parts.append("<p>No final weights.</p>")
    if run.checkpoints:
        rows = [[e(c.step), e(c.epoch if c.epoch is not None else "-"),
                 e(f"{c.loss:.5f}" if c.loss is not None else "-"), e(human_size(c.size)), f'<span class="uri">{e(c.uri)}</span>']
                for c in run.checkpoints]
        parts.append("<h3>Checkpoints</h3>" + table(["step", "epoch", "loss", "size", "URI"], rows, numeric={0, 1, 2, 3}))
    else:
        parts.append("<p>No complete checkpoint.</p>")
    if facts.best:
        rows = [[e(step), f'<span class="uri">{e(layout.join(run.uri, names[0].rsplit("/", 1)[0]))}</span>']
                for step, names in sorted(facts.best.items())]
        parts.append("<h3>Best by the monitored metric (spec.validation.keepBest)</h3>"
                     + table(["step", "URI"], rows, numeric={0}))
    parts.append(f"<p>Download: <code>kubetune checkpoints pull {e(run.uri)} --step final|latest|N -o DIR</code></p>")
    return "".join(parts)


def spec(facts: RunFacts) -> str:
    if facts.job_text is None:
        return f"<h2>Spec</h2><p>No {e(layout.JOB_FILE)} in the run.</p>"
    return (f'<h2>Spec</h2><p>The TrainingJob as the run trained it (its <code>{e(layout.JOB_FILE)}</code>):</p>'
            f'<pre id="spec">{e(facts.job_text)}</pre>')


def render(facts: RunFacts) -> str:
    """The page. The sections are drawn first: a damaged grid adds to `missing`, listed at the top."""
    sections = [overview(facts), curves(facts), validation_metrics(facts), grids(facts), weights(facts), spec(facts)]
    missing = ""
    if facts.missing:
        items = "".join(f"<li>{e(m)}</li>" for m in facts.missing)
        missing = f'<div class="missing" id="missing"><b>Not in this report:</b><ul>{items}</ul></div>'
    title = f"kubetune run report: {facts.name}"
    if facts.run.version is not None:
        title += f" {layout.version_name(facts.run.version)}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f'<body><h1>{e(title)}</h1>{missing}{"".join(sections)}'
            f'<p><small>Written {e(when(datetime.datetime.now(datetime.timezone.utc).timestamp()))} by kubetune.'
            f'</small></p></body></html>\n')
