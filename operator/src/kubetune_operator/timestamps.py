"""RFC 3339 times, as the API server writes them and kube.now() reads the clock, and Unix seconds."""
from __future__ import annotations

import datetime


def rfc3339(unix_seconds_: float) -> str:
    return datetime.datetime.fromtimestamp(unix_seconds_, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def unix_seconds(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
