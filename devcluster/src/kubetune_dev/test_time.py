"""Where a test run's time goes: a pytest plugin that records each test's window and CPU, and the
report that joins those records with the processes the run started (kubetune_dev.process_census).

`benchmarks/test_time.py` runs `make test` with this plugin (`-p kubetune_dev.test_time`) and the
census installed, then prints the report; `KUBETUNE_TEST_TIME` names the records folder. Records:
  tests-<worker>.jsonl  one line per test: its window (setup to teardown) and the worker's own CPU in
                        it, plus the CPU of the children it waited for
  servers.jsonl         after each test, the CPU so far of every process that is not Python and started
                        during the run (the control plane's Go binaries, the S3 server, Prometheus...)
  session.json          the run's start and end, as the xdist controller saw them
  procs/<pid>.jsonl     the census: every Python process's start, argv, import time and CPU
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RECORDS_VARIABLE = "KUBETUNE_TEST_TIME"
# The Go programs whose start is a control plane's (kubetune_dev.cluster starts one API server each).
CONTROL_PLANE_COMMAND = "kube-apiserver"
# A test that takes longer than this says why in its docstring (README, Testing).
LONG_TEST_SECONDS = 60


def _records() -> Path:
    return Path(os.environ[RECORDS_VARIABLE])


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _cpu() -> tuple[float, float]:
    times = os.times()
    return times.user + times.system, times.children_user + times.children_system


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def non_python_processes(since: float) -> dict[str, list]:
    """pid -> [command, start time, CPU seconds so far] of every process that is not Python and
    started after `since` (the control plane, servers, helm): their CPU is nobody's test's own."""
    boot = _boot_time()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        command = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        started = boot + int(fields[19]) / _CLOCK_TICKS
        if command.startswith("python") or started < since:
            continue
        found[entry.name] = [command, round(started, 2), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS]
    return found


def _append(name: str, line: dict) -> None:
    with open(_records() / name, "a") as out:
        out.write(json.dumps(line) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        (_records() / "procs").mkdir(parents=True, exist_ok=True)
        (_records() / "session.json").write_text(json.dumps({"start": time.time()}))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session) -> None:
    if not hasattr(session.config, "workerinput"):
        path = _records() / "session.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "end": time.time()}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, (own, children) = time.time(), _cpu()
    yield
    end, (own_after, children_after) = time.time(), _cpu()
    worker = _worker()
    _append(f"tests-{worker}.jsonl", {"nodeid": item.nodeid, "worker": worker, "start": start, "end": end,
                                      "own_cpu_s": round(own_after - own, 3),
                                      "waited_children_cpu_s": round(children_after - children, 3),
                                      "docstring": bool(getattr(getattr(item, "function", None), "__doc__", None))})
    session = json.loads((_records() / "session.json").read_text())
    _append("servers.jsonl", {"time": end, "worker": worker, "processes": non_python_processes(session["start"])})


# ---- the report --------------------------------------------------------------------------------


@dataclass
class Process:
    pid: int
    start: float
    argv: list[str]
    worker: str | None
    forked: bool
    end: float | None = None
    cpu_s: float | None = None
    import_s: float | None = None
    import_cpu_s: float | None = None

    @property
    def kind(self) -> str:
        """What the process ran, in a few words (the first module or script named)."""
        if self.forked:
            return "forked child"
        for flag, value in zip(self.argv, self.argv[1:]):
            if flag == "-m":
                return value
        if "-c" in self.argv:
            text = self.argv[self.argv.index("-c") + 1] if self.argv.index("-c") + 1 < len(self.argv) else ""
            # execnet's bootstrap: how pytest-xdist starts its workers (and their rsync helpers)
            return "pytest worker" if "sys.stdin.readline" in text else "python -c"
        return Path(self.argv[0]).name if self.argv else "?"


@dataclass
class Test:
    nodeid: str
    worker: str
    start: float
    end: float
    own_cpu_s: float
    waited_children_cpu_s: float
    docstring: bool = False  # whether the test function says what it is about (and, past a minute, why)
    processes: list[Process] = field(default_factory=list)
    server_cpu_s: float = 0.0
    control_planes: int = 0

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def file(self) -> str:
        return self.nodeid.split("::")[0]

    @property
    def cpu_s(self) -> float:
        """Its worker's CPU, its Python processes' (recorded at exit) and the servers' during it."""
        return self.own_cpu_s + sum(p.cpu_s or 0 for p in self.processes) + self.server_cpu_s


def read_processes(records: Path) -> list[Process]:
    processes = []
    for path in sorted((records / "procs").glob("*.jsonl")):
        current: Process | None = None
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if event["event"] == "start":
                if current is not None and current.end is None and not event["forked"]:
                    # the same pid again: an exec (the pod sandbox execs the container's command)
                    current.argv, current.worker = event["argv"], current.worker or event["worker"]
                    continue
                current = Process(event["pid"], event["time"], event["argv"], event["worker"], event["forked"])
                processes.append(current)
            elif current is not None:
                current.end, current.cpu_s, current.import_s = event["time"], event["cpu_s"], event["import_s"]
                current.import_cpu_s = event.get("import_cpu_s")
    return processes


def read_tests(records: Path) -> list[Test]:
    tests = []
    for path in sorted(records.glob("tests-*.jsonl")):
        tests += [Test(**json.loads(line)) for line in path.read_text().splitlines() if line]
    return sorted(tests, key=lambda t: t.start)


def attribute(tests: list[Test], processes: list[Process], records: Path) -> list[Process]:
    """Each process to the test running when it started: on its own worker when it inherited the
    worker's name, otherwise (a pod: its environment is the pod's) on the worker running e2e tests.
    Returns the processes no test window held (session set-up between tests)."""
    by_worker = defaultdict(list)
    for test in tests:
        by_worker[test.worker].append(test)
    e2e_workers = {t.worker for t in tests if t.nodeid.startswith("tests/e2e/")}

    def holder(worker_names, moment: float) -> Test | None:
        for name in worker_names:
            for test in by_worker.get(name, []):
                if test.start <= moment <= test.end:
                    return test
        return None

    unheld = []
    for process in processes:
        if process.kind in ("pytest worker", "pytest"):
            continue  # the test runner itself: its CPU is each test's own_cpu_s
        names = [process.worker] if process.worker else sorted(e2e_workers) + sorted(by_worker)
        test = holder(names, process.start)
        (test.processes if test else unheld).append(process)

    # The servers' CPU between two consecutive scans of a worker goes to the test that ended the window.
    previous: dict[str, dict] = {}
    seen_apiservers: set[str] = set()
    path = records / "servers.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        scan = json.loads(line)
        test = holder([scan["worker"]], scan["time"] - 1e-3) or holder([scan["worker"]], scan["time"])
        earlier = previous.get(scan["worker"], {})
        for pid, (command, started, cpu) in scan["processes"].items():
            if test is not None:
                test.server_cpu_s += max(0.0, cpu - earlier.get(pid, [None, None, 0.0])[2])
                if command == CONTROL_PLANE_COMMAND and pid not in seen_apiservers:
                    owner = holder(sorted(e2e_workers) + sorted(by_worker), started) or test
                    owner.control_planes += 1
            if command == CONTROL_PLANE_COMMAND:
                seen_apiservers.add(pid)
        previous[scan["worker"]] = scan["processes"]
    return unheld


def _row(cells: list, widths: list[int]) -> str:
    return "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))) + " |"


def table(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [_row(header, widths), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + [_row(r, widths) for r in rows])


def _imports(processes: list[Process]) -> str:
    """Their import seconds: wall / CPU."""
    return f"{sum(p.import_s or 0 for p in processes):.0f} / {sum(p.import_cpu_s or 0 for p in processes):.0f}"


def _summary(tests: list[Test]) -> list:
    processes = [p for t in tests for p in t.processes]
    return [len(tests), f"{sum(t.wall_s for t in tests):.0f}", f"{sum(t.cpu_s for t in tests):.0f}",
            len(processes), _imports(processes), sum(t.control_planes for t in tests)]


def report(records: Path, top: int = 40) -> str:
    tests, processes = read_tests(records), read_processes(records)
    unheld = attribute(tests, processes, records)
    session = json.loads((records / "session.json").read_text())
    wall = session.get("end", max((t.end for t in tests), default=session["start"])) - session["start"]
    columns = ["tests", "wall s", "CPU s", "Python processes", "their import s (wall / CPU)", "control planes"]
    out = [f"session wall {wall:.0f} s ({wall / 60:.1f} min), {len(tests)} tests, "
           f"{len(processes)} Python processes recorded ({sum(1 for p in processes if p.end is None)} without an "
           f"exit record: killed, or still running at the end), {len(unheld)} started outside any test"]

    out += ["", "### Workers", table(["worker", "tests", "busy s", "idle s", "first start", "last end"], [
        [name, len(ts), f"{sum(t.wall_s for t in ts):.0f}", f"{wall - sum(t.wall_s for t in ts):.0f}",
         f"+{min(t.start for t in ts) - session['start']:.0f} s", f"+{max(t.end for t in ts) - session['start']:.0f} s"]
        for name, ts in sorted(_group(tests, lambda t: t.worker).items())])]

    by_folder = _group(tests, lambda t: "/".join(t.file.split("/")[:2]))
    out += ["", "### By folder", table(["folder", *columns],
                                       [[k, *_summary(v)] for k, v in sorted(by_folder.items())])]
    by_file = sorted(_group(tests, lambda t: t.file).items(), key=lambda kv: -sum(t.wall_s for t in kv[1]))
    out += ["", "### By file (wall order)", table(["file", *columns], [[k, *_summary(v)] for k, v in by_file])]
    slowest = sorted(tests, key=lambda t: -t.wall_s)[:top]
    out += ["", f"### The {top} slowest tests", table(["test", "wall s", "CPU s", "Python processes",
                                                        "their import s (wall / CPU)", "control planes"], [
        [t.nodeid, f"{t.wall_s:.1f}", f"{t.cpu_s:.0f}", len(t.processes), _imports(t.processes), t.control_planes]
        for t in slowest])]
    long = [t for t in tests if t.wall_s > LONG_TEST_SECONDS]
    unexplained = sorted({t.nodeid.split("[")[0] for t in long if not t.docstring})
    out += ["", f"### Tests over {LONG_TEST_SECONDS} s: {len(long)}, of which {len(unexplained)} without a docstring "
                "saying why (README, Testing)", *[f"- {name}" for name in unexplained]]
    kinds = _group([p for t in tests for p in t.processes] + unheld, lambda p: p.kind)
    out += ["", "### Python processes by what they ran (CPU as recorded at a normal exit)", table(
        ["ran", "count", "import s (wall / CPU)", "CPU s", "mean import CPU s"], [
            [k, len(v), _imports(v), f"{sum(p.cpu_s or 0 for p in v):.0f}",
             f"{sum(p.import_cpu_s or 0 for p in v) / max(1, sum(1 for p in v if p.import_cpu_s is not None)):.2f}"]
            for k, v in sorted(kinds.items(), key=lambda kv: -sum(p.cpu_s or 0 for p in kv[1]))])]
    return "\n".join(out)


def _group(items, key) -> dict:
    groups = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups
