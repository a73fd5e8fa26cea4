"""Waiting for a cluster to reach a state, with a useful message when it does not."""
from __future__ import annotations

import time

import pytest


def eventually(check, timeout: float = 60, interval: float = 0.5, message="condition"):
    """Poll CHECK until it returns something truthy and return that; fail after TIMEOUT seconds.

    MESSAGE may be a callable, asked only on failure (e.g. to attach a log).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    pytest.fail(f"not reached within {timeout:.0f} s: {message() if callable(message) else message}")
