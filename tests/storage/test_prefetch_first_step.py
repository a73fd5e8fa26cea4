"""A training run's prefetcher fetches the first step alone until it is trained (the first step waits
for its own images only, not for the next steps' fetches beside them on the same cores); from then
on it keeps spec.data.streaming.prefetchSteps steps ahead, as before."""
from __future__ import annotations

import time
from pathlib import Path

from tests.storage.test_data_streaming import noise_captions, upload, wait_for


def test_the_first_step_is_fetched_alone_then_the_window_opens(bucket, tmp_path, monkeypatch):
    from kubetune_trainer.storage import stream

    local = noise_captions(tmp_path / "data", 8)
    upload(local, f"s3://{bucket}/streamed/first-step")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(f"s3://{bucket}/streamed/first-step"))
    steps = [[root / f"{2 * s:03d}.png", root / f"{2 * s + 1:03d}.png"] for s in range(4)]
    prefetcher = stream.Prefetcher(budget=1 << 30, ahead_steps=3, first_step_alone=True)
    try:
        prefetcher.plan(steps)
        wait_for(lambda: prefetcher.fetched == 1, "the first step fetched")
        time.sleep(0.2)
        assert prefetcher.fetched == 1, "nothing beyond the first step before it is trained"
        assert all(p.stat().st_size > 0 for p in steps[0]) and all(p.stat().st_size == 0 for p in steps[1])
        prefetcher.advance()
        wait_for(lambda: prefetcher.fetched == 4, "then prefetchSteps (3) steps ahead of the one trained")
        assert all(p.stat().st_size > 0 for step in steps[1:] for p in step)
    finally:
        prefetcher.close()
