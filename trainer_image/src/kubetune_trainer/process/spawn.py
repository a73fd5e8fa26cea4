"""How trainer processes are started: the launcher's workers and `kubetune sweep`'s trials.

One function, so that there is one place to change how: the test suite forks these processes from an
interpreter that already imported torch and diffusers instead of starting a new one, where a test is not
about how a process starts (tests/warm_python.py replaces `start` in the processes it forks).
"""
from __future__ import annotations

import subprocess


def start(command: list[str], env: dict[str, str], **stdio) -> subprocess.Popen:
    """`subprocess.Popen(command, env=env, **stdio)`; stdio: stdout and stderr as Popen takes them."""
    return subprocess.Popen(command, env=env, **stdio)
