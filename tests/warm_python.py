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
  * a caller that gives up (its timeout) closes the connection and the keeper kills the process's group;
  * a forked process starts its own trainer processes (the launcher's workers of `kubetune train --nproc N`,
    `kubetune sweep`'s trials: kubetune_trainer.process.spawn) as forks of the same server, through
    `WarmProcess`, the part of subprocess.Popen they use. Their launcher's death reaches them as the
    keeper's SIGKILL when its connection closes, instead of PR_SET_PDEATHSIG's SIGTERM.

Only a request whose environment is the server's own, but for variables read when a process runs rather
than when a library is imported (RUN_TIME_VARIABLES), is forked: a library that read HF_HOME or
OMP_NUM_THREADS at import would otherwise keep the server's value. Any other request starts a fresh
interpreter, as subprocess.run would. Whatever tests process start-up itself (signals to a launcher, a
parent's death, a launcher's own process) keeps using subprocess: a launcher started by subprocess starts
its workers as users' launchers do.
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
# The rendezvous a launcher gives each worker (kubetune_trainer.process.launcher.worker_env) is read by
# torch.distributed when the process group starts.
RUN_TIME_VARIABLES = ("AWS_", "KUBETUNE_", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "MASTER_ADDR",
                      "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
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


def _request(socket_path: str, module: str, args: list[str], env: dict[str, str], cwd: str,
             stdio: list[int]) -> socket.socket:
    """Ask the server at socket_path for `python -m MODULE ARGS` with these stdin, stdout and stderr; the
    connection, on which the keeper answers with the process's pid, then with how it ended."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd}).encode()
    conn.sendmsg([len(request).to_bytes(4, "big") + request],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", stdio))])
    return conn


class _Answers:
    """The keeper's answers on a connection: one JSON object a line."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.pending = b""

    def next(self) -> dict:
        """The next answer; socket.timeout or BlockingIOError as the connection's mode raises them."""
        while b"\n" not in self.pending:
            chunk = self.conn.recv(MAX_MESSAGE)
            if not chunk:
                raise RuntimeError("the warm interpreter's keeper ended without an answer")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


def run(command: list[str], env: dict[str, str], timeout: float, cwd: str | Path | None = None
        ) -> subprocess.CompletedProcess:
    """subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout), forked from this
    worker's warm interpreter when command is `python -m MODULE ...` and env allows."""
    found = module_of(command)
    server = _server_for(env) if found else None
    if server is None:
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    module, args = found
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as devnull:
        with _request(str(server.socket_path), module, args, env, str(cwd or os.getcwd()),
                      [devnull.fileno(), out.fileno(), err.fileno()]) as conn:
            conn.settimeout(timeout)
            answers = _Answers(conn)
            try:
                answers.next()  # its pid
                returncode = answers.next()["returncode"]
            except socket.timeout:
                raise subprocess.TimeoutExpired(command, timeout) from None  # closing conn kills the process
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


class WarmProcess:
    """A trainer process that a forked process starts, forked from the same server: what the launcher
    and `kubetune sweep` use of subprocess.Popen (pid, poll, wait, send_signal, kill, returncode). The
    connection stays open while it runs; the caller's end closing (it exited, or was killed) makes the
    keeper kill the process's group, as a launcher's death stops its workers."""

    def __init__(self, socket_path: str, module: str, args: list[str], env: dict[str, str], stdio: list[int]):
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        self._conn = _request(socket_path, module, args, env, os.getcwd(), stdio)
        self._answers = _Answers(self._conn)
        self.pid: int = self._answers.next()["pid"]
        self._conn.setblocking(False)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._ended(self._answers.next()["returncode"])
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._ended(self._answers.next()["returncode"])
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                if self.returncode is None:
                    self._conn.setblocking(False)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, returncode: int) -> None:
        self.returncode = returncode
        self._conn.close()


def _start_from_server(socket_path: str, server_env: dict[str, str], start, command: list[str], env: dict[str, str],
                       stdout=None, stderr=None):
    """kubetune_trainer.process.spawn.start in a process this server forked: a WarmProcess where the
    command and environment allow, else START (spawn.start itself)."""
    found = module_of(command)
    if found is None or not _same_at_import(server_env, env):
        return start(command, env, stdout=stdout, stderr=stderr)
    out = 1 if stdout is None else stdout.fileno()
    err = out if stderr == subprocess.STDOUT else 2 if stderr is None else stderr.fileno()
    return WarmProcess(socket_path, *found, env, [0, out, err])


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


def _become(request: dict, fds: list[int], socket_path: str, server_env: dict[str, str]) -> None:
    """In the forked process: the caller's stdio, directory, environment and argv, then `-m MODULE`; the
    trainer processes it starts are forked from this server too (WarmProcess)."""
    import functools
    import runpy

    from kubetune_trainer.process import parent_watch, spawn

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if parent_watch.LAUNCHER_PID_VARIABLE in os.environ:  # a launcher's worker: its parent is the keeper,
        os.environ[parent_watch.LAUNCHER_PID_VARIABLE] = str(os.getppid())  # which outlives it by design
    spawn.start = functools.partial(_start_from_server, socket_path, server_env, spawn.start)
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


def _keep(conn: socket.socket, request: dict, fds: list[int], socket_path: str, server_env: dict[str, str]
          ) -> None:
    """The keeper: forks the process, answers with its pid and then with how it ended, kills its group if
    the caller left."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    child = os.fork()
    if child == 0:
        conn.close()
        _become(request, fds, socket_path, server_env)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
    except OSError:
        pass  # the caller is gone: the loop below sees it
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
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
    server_env = dict(os.environ)
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
            _keep(conn, request, fds, socket_path, server_env)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
