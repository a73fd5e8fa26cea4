"""`python -m MODULE ARGS` without its imports: a trainer process forked from an interpreter that already
imported torch, diffusers, transformers, peft and our packages (a fork server), for the tests whose subject
is not how a process starts.

A fresh trainer process spends ~9 s of CPU importing its libraries before it reads its config (measured:
benchmarks/test_time.py), and the tests start about a hundred of them. `run(command, env=...)` answers
as `subprocess.run(command, capture_output=True, text=True, env=env)` does, but forks the process from
this worker's server instead of starting an interpreter:

  * the server (`python -m tests.warm_python SOCKET`, one per test worker, started on first use) imports
    every module of our packages once with the environment the tests give trainers (trainer_env), then
    waits; it never runs a step itself, so each fork starts from a clean, single-threaded interpreter;
  * for a request it forks a keeper, which forks the process itself in a session of its own with the
    caller's stdin/stdout/stderr, working directory, environment and argv, runs the module as `python -m`
    does (runpy), and reports how it ended: its exit code, or minus the signal that killed it;
  * a caller that gives up (its timeout) closes the connection and the keeper kills the process's group.

Only a request whose environment is the server's own, but for variables read when a process runs rather
than when a library is imported (RUN_TIME_VARIABLES), is forked: a library that read HF_HOME or
OMP_NUM_THREADS at import would otherwise keep the server's value. Any other request starts a fresh
interpreter, as subprocess.run would. Whatever tests process start-up itself (signals to a launcher, a
parent's death, `kubetune train --nproc N`'s workers) keeps using subprocess.
"""
from __future__ import annotations

import array
import atexit
import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Read when a process runs, not when a library is imported: a request may differ from the server in these.
# TORCHINDUCTOR_CACHE_DIR: torch writes its default into os.environ the first time a process asks for
# its compile cache, so a test worker's environment gains it halfway through the session.
RUN_TIME_VARIABLES = ("AWS_", "KUBETUNE_", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
PACKAGES = ("kubetune_api", "kubetune_trainer", "kubetune_cli")
MAX_MESSAGE = 1 << 20


# ---- the caller's side -------------------------------------------------------------------------

class _Server:
    """This test worker's server: started on first use with `env`, stopped when the worker exits."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.socket_path = Path(tempfile.mkdtemp(prefix="kubetune-warm-")) / "server.sock"
        self.process = subprocess.Popen([sys.executable, "-m", "tests.warm_python", str(self.socket_path)],
                                        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        text=True)
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm interpreter did not start (exit {self.process.poll()}): {ready!r}")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.socket_path.unlink(missing_ok=True)
        self.socket_path.parent.rmdir()


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def _same_at_import(a: dict[str, str], b: dict[str, str]) -> bool:
    def kept(env):
        return {k: v for k, v in env.items() if not k.startswith(RUN_TIME_VARIABLES)}
    return kept(a) == kept(b)


# The environment trainers get from the tests (tests/trainer/conftest.trainer_env), as this worker had it
# before any test ran: a test that changes os.environ (monkeypatch) must not become the server's.
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _server_for(env: dict[str, str]) -> _Server | None:
    if not _same_at_import(SERVER_ENV, env):
        if os.environ.get("KUBETUNE_WARM_DEBUG"):
            names = sorted(k for k in set(SERVER_ENV) | set(env) if SERVER_ENV.get(k) != env.get(k))
            with open(os.environ["KUBETUNE_WARM_DEBUG"], "a") as log:
                log.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}: cold, differs in {names}\n")
        return None
    with _lock:
        if "server" not in _servers:
            _servers["server"] = _Server(SERVER_ENV)
        return _servers["server"]


def module_of(command: list[str]) -> tuple[str, list[str]] | None:
    """(MODULE, ARGS) of `[sys.executable, "-m", MODULE, *ARGS]`, else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2], list(command[3:])
    return None


def run(command: list[str], env: dict[str, str], timeout: float, cwd: str | Path | None = None
        ) -> subprocess.CompletedProcess:
    """subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout), forked from this
    worker's warm interpreter when command is `python -m MODULE ...` and env allows."""
    found = module_of(command)
    server = _server_for(env) if found else None
    if server is None:
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    module, args = found
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as devnull, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(server.socket_path))
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": str(cwd or os.getcwd())}).encode()
        conn.sendmsg([len(request).to_bytes(4, "big") + request], [(
            socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [devnull.fileno(), out.fileno(), err.fileno()]))])
        conn.settimeout(timeout)
        try:
            reply = conn.recv(MAX_MESSAGE)
        except socket.timeout:
            raise subprocess.TimeoutExpired(command, timeout) from None  # closing conn kills the process
        if not reply:
            raise RuntimeError("the warm interpreter's keeper ended without an answer")
        returncode = json.loads(reply)["returncode"]
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


# ---- the server's side ---------------------------------------------------------------------------

def import_everything() -> None:
    """Every module of our packages, hence every library they import at module level."""
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)  # a module that cannot import here cannot in a trainer


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request: its length (4 bytes), its JSON, and the caller's three stdio descriptors beside it.
    The connection stays open: the keeper reads its end as the caller leaving."""
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk, ancillary, _, _ = conn.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(3 * array.array("i").itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", payload[:len(payload) - len(payload) % 4]).tolist()
        if not chunk:
            raise ConnectionError("the caller left before its request was whole")
        data += chunk
    return json.loads(data[4:]), fds


def _become(request: dict, fds: list[int]) -> None:
    """In the forked process: the caller's stdio, directory, environment and argv, then `-m MODULE`."""
    import runpy

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = ["-m", *request["args"]]
    try:
        runpy._run_module_as_main(request["module"], alter_argv=True)  # exactly what `python -m` calls
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's own exit, less the teardown of thousands of modules (a second of CPU): wait for
    # non-daemon threads, run atexit, flush.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_status(code) -> int:
    """What an interpreter exits with for sys.exit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _keep(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The keeper: forks the process, answers with how it ended, kills its group if the caller left."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    child = os.fork()
    if child == 0:
        conn.close()
        _become(request, fds)
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall(json.dumps({"returncode": code}).encode())
            except OSError:
                pass
            os._exit(0)
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):  # the caller gave up: its process goes with it
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(child, 0)
            os._exit(0)


def serve(socket_path: str) -> None:
    import_everything()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        if os.getppid() != parent:
            os._exit(0)  # the test worker is gone
        if not readable:
            continue
        conn, _ = listener.accept()
        request, fds = _receive(conn)
        if os.fork() == 0:
            listener.close()
            _keep(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
