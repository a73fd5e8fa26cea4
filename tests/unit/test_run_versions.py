"""Run versions and the background uploader: the decisions, without storage or network."""
from __future__ import annotations

import threading

import pytest

from kubetune_api import layout
from kubetune_trainer.checkpoint import runs
from kubetune_trainer.checkpoint.runs import RunRecord, choose_version
from kubetune_trainer.storage.tree import LocalTree
from kubetune_trainer.storage.uploader import BackgroundUploader, Task, UploadFailed

FINISHED = dict(steps=100, finished=True)


@pytest.mark.parametrize("existing, run_id, expected", [
    ([], None, (0, False, (), ())),
    ([RunRecord(0, "a", **FINISHED)], None, (1, False, (), (0,))),
    ([RunRecord(0, "a", **FINISHED)], "a", (0, True, (), ())),
    ([RunRecord(0, "a", **FINISHED), RunRecord(1, "b", steps=3)], "c", (2, False, (1,), (0,))),
    ([RunRecord(0, "a", steps=3)], "a", (0, True, (), ())),  # its own run is never abandoned
    ([RunRecord(0, "a", steps=2, finished=True)], None, (1, False, (), (0,))),  # short but finished: kept
    # No readable run.json: kept (it may hold intact checkpoints), and its number is never reused.
    ([RunRecord(0, readable=False), RunRecord(4, "x", steps=9)], None, (5, False, (), (4, 0))),
], ids=["first", "next", "restart", "cleanup", "own-short", "short-finished", "unreadable-kept"])
def test_choosing_a_version(existing, run_id, expected):
    choice = choose_version(existing, run_id)
    assert (choice.version, choice.continuing, choice.abandoned, choice.earlier) == expected


def test_versions_are_read_from_run_json_and_strays_are_ignored(tmp_path):
    job = LocalTree(tmp_path)
    job.child("v0").write_text(layout.RUN_FILE, runs.run_record_text("a", steps=9, finished=True))
    job.child("v3").write_text(layout.RUN_FILE, "{not json")
    (tmp_path / "notes").mkdir()
    (tmp_path / "v2x").mkdir()
    job.child("v4").write_text(layout.RUN_FILE, '{"runId": 7, "steps": "many", "finished": "yes"}')
    (tmp_path / "v5").mkdir()  # no run.json at all
    assert runs.read_runs(job) == [RunRecord(0, "a", 9, True), RunRecord(3, readable=False),
                                   RunRecord(4, readable=False), RunRecord(5, readable=False)]
    assert not any(r.abandoned for r in runs.read_runs(job)), "an unreadable record never marks a run abandoned"


def test_layout_parses_only_what_it_writes():
    assert layout.run_root("s3://b/p/", "ns", "job", 2) == "s3://b/p/ns/job/v2"
    assert layout.parse_version("v12") == 12 and layout.parse_version("v") is None
    assert layout.parse_checkpoint("checkpoint-40") == 40 and layout.parse_checkpoint("checkpoint-4a") is None


def test_a_failing_upload_is_retried_until_it_succeeds_and_timed_from_the_first_try():
    attempts, done = [], []
    uploader = BackgroundUploader(max_pause_seconds=0.01)

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("endpoint down")
    uploader.submit(Task("checkpoint-2", flaky, on_done=done.append))
    assert uploader.flush(timeout=30)
    assert len(attempts) == 3 and len(done) == 1 and done[0] > 0
    uploader.close()


def test_a_required_upload_that_gives_up_fails_the_flush_but_an_optional_one_does_not():
    uploader = BackgroundUploader(give_up_seconds=0.05, max_pause_seconds=0.01)
    uploader.submit(Task("run.json", lambda: 1 / 0))
    assert uploader.flush(timeout=30)
    uploader.submit(Task("final weights", lambda: 1 / 0, required=True))
    with pytest.raises(UploadFailed, match="final weights"):
        uploader.flush(timeout=30)
    uploader.close()


def test_a_newer_checkpoint_supersedes_one_still_waiting_but_not_other_uploads():
    gate, order, skipped = threading.Event(), [], []
    uploader = BackgroundUploader()
    uploader.submit(Task("in flight", gate.wait))
    uploader.submit(Task("checkpoint-2", lambda: order.append(2), on_skipped=lambda: skipped.append(2),
                         supersedable=True))
    uploader.submit(Task("run.json", lambda: order.append("run")))
    uploader.submit(Task("checkpoint-4", lambda: order.append(4), supersedable=True))
    assert uploader.pending() == 3
    gate.set()
    assert uploader.flush(timeout=30)
    assert order == ["run", 4] and skipped == [2]
    uploader.close()
