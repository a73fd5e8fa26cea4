"""A node's launcher: starts this node's trainer processes and answers for them.

It is the container's main process (PID 1 in a pod) and what `kubetune train --nproc N` runs.
It replaces torchrun / `accelerate launch` because of how they stop: on SIGTERM torchrun raises
its own exception and exits 1, which a PyTorchJob's ExitCode restart policy treats as a
permanent failure, and it SIGKILLs its workers 30 s later, in the middle of a last checkpoint
that the pod's grace period leaves room for. Here:

  * every worker gets the rendezvous environment torchrun would give it (static: MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK...), so torch.distributed and Accelerate start
    as usual;
  * SIGTERM or SIGINT (Ctrl-C) is passed on to every worker, which take one last checkpoint together
    and exit 143; the launcher waits for them as long as they need (the kubelet's grace period
    is the limit, not ours);
  * a launcher killed outright (SIGKILL) leaves no worker behind: each asks the kernel for
    SIGTERM when its launcher dies (kubetune_trainer.process.parent_watch) and stops as above;
  * when a worker fails on its own, the others are asked to stop (SIGTERM, then SIGKILL after
    WORKER_STOP_SECONDS) and the node exits with the failure's code, so the restart policy
    sees why the node stopped (node_exit_code).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from kubetune_trainer.process import spawn
from kubetune_trainer.process.parent_watch import LAUNCHER_PID_VARIABLE
from kubetune_trainer.process.preemption import CONFIG_ERROR_EXIT_CODE, RETRYABLE_EXIT_CODE

log = logging.getLogger("kubetune.launcher")

# How long workers get to stop after one of them failed (they cannot checkpoint without it).
WORKER_STOP_SECONDS = 60


@dataclass(frozen=True)
class NodePlace:
    """Where this node stands in the job."""

    processes: int  # trainer processes on this node
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def world_size(self) -> int:
        return self.processes * self.nodes


def worker_env(base: dict[str, str], place: NodePlace, local_rank: int) -> dict[str, str]:
    """The environment of one worker: what torchrun's static rendezvous would set."""
    rank = place.node_rank * place.processes + local_rank
    return {
        **base,
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        "WORLD_SIZE": str(place.world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(place.processes),
        "GROUP_RANK": str(place.node_rank),
        "NODE_RANK": str(place.node_rank),
        # Several processes on one node's cores: one thread each unless told otherwise (as torchrun).
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
    }


def returncode_as_exit_code(returncode: int) -> int:
    """A worker killed by signal N (returncode -N) reads as the shell's 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def node_exit_code(stopped_from_outside: bool, first_failure: int | None) -> int:
    """What the node reports when its workers are all gone.

    stopped_from_outside: SIGTERM/SIGINT reached the launcher before any worker failed.
    first_failure: the exit code of the first worker that ended with one other than 0.
    A stop from outside is retryable (143) unless a worker refused the job itself (bad input,
    2: retrying cannot help); otherwise the first failure is the cause, whatever the others
    did after it (they were stopped because of it).
    """
    if first_failure == CONFIG_ERROR_EXIT_CODE:
        return first_failure
    if stopped_from_outside:
        return RETRYABLE_EXIT_CODE
    return first_failure or 0


class Launcher:
    """Runs `command` once per local rank and supervises the workers until all have exited."""

    def __init__(self, command: list[str], place: NodePlace, env: dict[str, str] | None = None,
                 stop_seconds: float = WORKER_STOP_SECONDS):
        self.command = command
        self.place = place
        self.env = dict(os.environ if env is None else env)
        self.stop_seconds = stop_seconds
        self.workers: list[subprocess.Popen] = []
        self.stopped_from_outside = False
        self._stop_signal: int | None = None
        self.first_failure: int | None = None
        self._kill_at: float | None = None

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for local_rank in range(self.place.processes):
                env = {**worker_env(self.env, self.place, local_rank), LAUNCHER_PID_VARIABLE: str(os.getpid())}
                self.workers.append(spawn.start(self.command, env))
            if self._stop_signal is not None:  # it came while the workers started: tell the late ones too
                self._signal_running(self._stop_signal)
            self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_all()  # only reached early by an error of the launcher itself
        return node_exit_code(self.stopped_from_outside, self.first_failure)

    def _on_stop_signal(self, signum: int, frame) -> None:
        if self.first_failure is None and not self.stopped_from_outside:
            log.warning("%s: asking %d trainer process(es) to take a last checkpoint and stop",
                        signal.Signals(signum).name, len(self.workers))
            self.stopped_from_outside = True
        self._stop_signal = signum
        self._signal_running(signum)  # the trainers treat SIGINT (Ctrl-C) as SIGTERM

    def _supervise(self) -> None:
        running = set(range(len(self.workers)))
        while running:
            for index in sorted(running):
                returncode = self.workers[index].poll()
                if returncode is None:
                    continue
                running.discard(index)
                self._worker_ended(index, returncode_as_exit_code(returncode))
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                log.error("trainer processes still running %d s after a failure: killing them", self.stop_seconds)
                self._signal_running(signal.SIGKILL)
                self._kill_at = None
            time.sleep(0.1)

    def _worker_ended(self, index: int, code: int) -> None:
        if code == 0 or self.first_failure is not None:
            return
        self.first_failure = code
        if self.stopped_from_outside or code == RETRYABLE_EXIT_CODE:
            return  # the others are stopping the same way (the stop is agreed between all ranks)
        log.error("trainer process %d exited with %d: stopping the others", index, code)
        self._signal_running(signal.SIGTERM)
        self._kill_at = time.monotonic() + self.stop_seconds

    def _signal_running(self, sig: int) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    worker.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _kill_all(self) -> None:
        self._signal_running(signal.SIGKILL)
        for worker in self.workers:
            worker.wait()


def launch(command: list[str], place: NodePlace, env: dict[str, str] | None = None) -> int:
    """Start this node's trainer processes and return the node's exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return Launcher(command, place, env).run()
