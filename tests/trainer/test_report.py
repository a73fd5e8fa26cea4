"""The run report (kubetune_trainer.results.run_report): written by the trainer beside the weights and by
`kubetune report`, and opened in a real headless Chromium (devcluster/chromium.sh, `make browser`):
no broken picture, the curves drawn, every validation grid in step order, the spec shown."""
from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from kubetune_api import layout
from kubetune_cli.main import cli
from kubetune_trainer.checkpoint.catalog import describe_run
from tests.trainer.conftest import VALIDATION_PROMPT

pytestmark = pytest.mark.slow

# Appended to a copy of the page (the report itself carries no script): what the browser made of it.
CHECK_SCRIPT = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const found = {
    images: images.length,
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    curves: Array.from(document.querySelectorAll("img.curve")).filter(i => i.naturalWidth > 0).map(i => i.id),
    grids: Array.from(document.querySelectorAll("img.grid")).filter(i => i.naturalWidth > 0).map(i => i.alt),
    spec: document.getElementById("spec") ? document.getElementById("spec").textContent : null,
    missing: document.getElementById("missing") ? document.getElementById("missing").textContent : null,
  };
  const out = document.createElement("pre");
  out.id = "kubetune-check";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>"""


def browser_path() -> Path:
    """The headless Chromium devcluster/chromium.sh unpacked. Missing is a failure, never a skip: the
    page must have been seen in a browser."""
    named = os.environ.get("KUBETUNE_CHROMIUM")
    cache = Path(os.environ.get("KUBETUNE_CACHE") or Path.home() / ".cache" / "kubetune")
    pointer = cache / "chromium-headless-shell.path"
    path = Path(named) if named else Path(pointer.read_text().strip()) if pointer.is_file() else None
    if path is None or not os.access(path, os.X_OK):
        pytest.fail(f"no headless Chromium at {path or pointer}: run `make browser` (devcluster/chromium.sh)")
    return path


def open_in_browser(page: Path, work: Path) -> dict:
    """Load PAGE in headless Chromium and return what the check script saw once it loaded."""
    checked = work / f"checked-{page.name}"
    checked.write_text(page.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    result = subprocess.run([str(browser_path()), "--headless", "--no-sandbox", "--disable-gpu",
                             f"--user-data-dir={work / 'chromium-profile'}", "--virtual-time-budget=10000",
                             "--dump-dom", checked.as_uri()],
                            capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="kubetune-check">(.*?)</pre>', result.stdout, re.S)
    assert match, f"the page did not finish loading in Chromium (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(html.unescape(match.group(1)))


@pytest.fixture
def trained(validated_sd15_run) -> Path:
    """The session's tiny run with held-out data (validation loss) and a prompt (grids), validating and
    checkpointing at steps 1 and 2 (the base at step 0)."""
    return validated_sd15_run


def kubetune(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def sample_steps(run: Path) -> list[int]:
    return sorted(int(folder.name.removeprefix("step-")) for folder in (run / "samples").iterdir())


def grid_labels(steps: list[int]) -> list[str]:
    return [f"validation samples at {'base' if step == 0 else f'step {step}'}" for step in steps]


def test_the_trainer_writes_its_report_beside_the_weights_and_it_renders(trained, tmp_path):
    page = trained / layout.REPORT_FILE
    assert page.is_file()
    assert layout.REPORT_FILE not in describe_run(str(trained), 0).final_files, "a report is not weights"
    seen = open_in_browser(page, tmp_path)
    assert seen["broken"] == [] and seen["images"] > 0
    assert seen["curves"] == ["training-curves", "validation-curves"]
    assert seen["grids"] == grid_labels(sample_steps(trained)), "every validation grid, in step order"
    assert VALIDATION_PROMPT in seen["spec"] and "everySteps: 1" in seen["spec"]
    assert seen["missing"] is None, "a finished run with logs and samples lacks nothing"


def test_kubetune_report_writes_a_page_that_renders_in_chromium(trained, tmp_path):
    out = tmp_path / "my-report.html"
    result = kubetune("report", str(trained.parent), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert str(out) in result.output
    text = out.read_text()
    assert 'src="http' not in text and "<script" not in text, "self-contained: nothing fetched, nothing run"
    for checkpoint in (1, 2):
        assert f"{trained}/checkpoint-{checkpoint}" in text, "where each checkpoint is"
    seen = open_in_browser(out, tmp_path)
    assert seen["broken"] == []
    assert seen["curves"] == ["training-curves", "validation-curves"]
    assert seen["grids"] == grid_labels(sample_steps(trained))
    assert (trained / layout.JOB_FILE).read_text().strip() == seen["spec"].strip()


def test_a_run_without_logs_still_gets_a_report_that_says_what_is_missing(trained, tmp_path):
    bare = tmp_path / "bare" / "v0"
    shutil.copytree(trained, bare, ignore=shutil.ignore_patterns("logs", "samples", layout.REPORT_FILE))
    out = tmp_path / "bare.html"
    result = kubetune("report", str(bare), "--out", str(out))
    assert result.exit_code == 0, result.output
    seen = open_in_browser(out, tmp_path)
    assert seen["broken"] == [] and seen["curves"] == [] and seen["grids"] == []
    assert "no TensorBoard event files under logs/" in seen["missing"]
    assert "no validation grids" in seen["missing"]
    assert seen["spec"] is not None, "what the run still has is shown"


def test_grids_start_with_the_base_and_a_damaged_one_is_named_not_shown_broken(trained, tmp_path):
    copy = tmp_path / "copy" / "v0"
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns(layout.REPORT_FILE))
    damaged = copy / "samples" / "step-0000003"
    damaged.mkdir()
    (damaged / "grid.png").write_bytes(b"\x89PNG truncated")
    out = tmp_path / "report.html"
    assert kubetune("report", str(copy), "--out", str(out)).exit_code == 0
    seen = open_in_browser(out, tmp_path)
    assert seen["grids"] == ["validation samples at base", "validation samples at step 1",
                             "validation samples at step 2"], "step 0, the base model, comes first"
    assert seen["broken"] == []
    assert "samples/step-0000003/grid.png could not be read" in seen["missing"]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_report_never_writes_through_a_symlink(trained, tmp_path, force):
    target = tmp_path / "elsewhere.html"
    target.write_text("keep me")
    link = tmp_path / "report.html"
    link.symlink_to(target)
    result = kubetune("report", str(trained), "--out", str(link), *(["--force"] if force else []))
    assert result.exit_code == 2
    assert result.output.strip() == (f"kubetune report: --out {link} is a symbolic link: kubetune never writes "
                                     "through one; remove it or pick another path")
    assert target.read_text() == "keep me" and link.is_symlink()


def test_report_refuses_an_existing_file_without_force_and_replaces_it_with(trained, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("an older report")
    refused = kubetune("report", str(trained), "--out", str(out))
    assert refused.exit_code == 2
    assert refused.output.strip() == f"kubetune report: --out {out} exists: pass --force to replace it, or pick another path"
    assert out.read_text() == "an older report"
    forced = kubetune("report", str(trained), "--out", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert "training-curves" in out.read_text()


def test_report_of_a_job_with_no_runs_is_one_line(tmp_path):
    empty = tmp_path / "out" / "default" / "nothing"
    empty.mkdir(parents=True)
    result = kubetune("report", str(empty), "--out", str(tmp_path / "r.html"))
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and f"no runs under {empty}" in result.output
    assert not (tmp_path / "r.html").exists()


def test_report_of_a_run_version_that_does_not_exist_names_those_that_do(trained, tmp_path):
    result = kubetune("report", str(trained.parent), "--version", "7", "--out", str(tmp_path / "r.html"))
    assert result.exit_code == 2
    assert result.output.strip() == "kubetune report: --version 7: no such run; there are v0"
    assert not (tmp_path / "r.html").exists()


def test_a_report_that_cannot_be_written_never_fails_the_run(tmp_path, caplog):
    from kubetune_trainer.run import Run

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # the report's folder is a file: writing it must fail
    published = []
    run = SimpleNamespace(run_place=SimpleNamespace(uri=str(blocker), version=0), output=blocker,
                          store=SimpleNamespace(publish_files=lambda files, name: published.append(files),
                                                flush=lambda: True),
                          _store_uri=str)
    with caplog.at_level(logging.WARNING, logger="kubetune.trainer"):
        Run._write_report(run)
    assert published == []
    assert "could not write the run's report" in caplog.text and f"kubetune report {blocker}" in caplog.text
