"""benchmarks/test_time.py's report: each Python process goes to the test that was running when it
started (on its own worker, or for a pod on the e2e worker), an exec'd process is one process, and the
servers' CPU and control-plane starts go to the test during which they happened."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kubetune_dev import process_census
from kubetune_dev.test_time import attribute, read_processes, read_tests, report


def write_lines(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def start(pid, time, argv, worker=None, forked=False):
    return {"event": "start", "pid": pid, "ppid": 1, "time": time, "argv": argv, "worker": worker, "forked": forked}


def test_processes_servers_and_control_planes_go_to_the_test_running_when_they_started(tmp_path):
    (tmp_path / "session.json").write_text(json.dumps({"start": 0.0, "end": 100.0}))
    write_lines(tmp_path / "tests-gw0.jsonl", [
        {"nodeid": "tests/e2e/test_a.py::test_one", "worker": "gw0", "start": 1.0, "end": 40.0,
         "own_cpu_s": 2.0, "waited_children_cpu_s": 0.0},
        {"nodeid": "tests/e2e/test_a.py::test_two", "worker": "gw0", "start": 40.0, "end": 90.0,
         "own_cpu_s": 1.0, "waited_children_cpu_s": 0.0}])
    write_lines(tmp_path / "tests-gw1.jsonl", [
        {"nodeid": "tests/trainer/test_b.py::test_three", "worker": "gw1", "start": 2.0, "end": 60.0,
         "own_cpu_s": 3.0, "waited_children_cpu_s": 9.0}])
    procs = tmp_path / "procs"
    # A trainer started by gw1's test at 10 s; a pod (no worker in its environment) at 10 s: e2e's.
    write_lines(procs / "11.jsonl", [start(11, 10.0, ["-m", "kubetune_trainer"], "gw1"),
                                     {"event": "exit", "pid": 11, "time": 20.0, "cpu_s": 9.0, "import_s": 6.0,
                                      "import_cpu_s": 5.0}])
    # The pod's sandbox execs the container's command in the same process: one process, the second argv.
    write_lines(procs / "12.jsonl", [start(12, 10.0, ["-m", "kubetune_dev.sandbox"]),
                                     start(12, 10.1, ["-m", "kubetune_trainer.pod"]),
                                     {"event": "exit", "pid": 12, "time": 30.0, "cpu_s": 7.0, "import_s": 5.0,
                                      "import_cpu_s": 4.0}])
    # A loader worker forked from the pod's process, killed (no exit line), during test_two.
    write_lines(procs / "13.jsonl", [start(13, 45.0, ["-m", "kubetune_trainer.pod"], forked=True)])
    # The control plane starts during test_one and burns 4 s of CPU before its first scan, 6 s more by the next.
    scans = [{"time": 40.0, "worker": "gw0", "processes": {"500": ["kube-apiserver", 5.0, 4.0]}},
             {"time": 90.0, "worker": "gw0", "processes": {"500": ["kube-apiserver", 5.0, 10.0]}}]
    write_lines(tmp_path / "servers.jsonl", scans)

    tests, processes = read_tests(tmp_path), read_processes(tmp_path)
    assert [p.kind for p in processes] == ["kubetune_trainer", "kubetune_trainer.pod", "forked child"]
    unheld = attribute(tests, processes, tmp_path)
    by_id = {t.nodeid.split("::")[1]: t for t in tests}

    assert unheld == []
    assert [p.pid for p in by_id["test_three"].processes] == [11]
    assert [p.pid for p in by_id["test_one"].processes] == [12], "a pod goes to the e2e worker's test"
    assert [p.pid for p in by_id["test_two"].processes] == [13]
    assert (by_id["test_one"].server_cpu_s, by_id["test_two"].server_cpu_s) == (4.0, 6.0)
    assert (by_id["test_one"].control_planes, by_id["test_two"].control_planes) == (1, 0)
    assert by_id["test_one"].cpu_s == 2.0 + 7.0 + 4.0
    text = report(tmp_path)
    assert "| gw0    |     2 |     89 |     11 |" in text, text
    assert "| kubetune_trainer.pod |     1 |                 5 / 4 |     7 |" in text, text


def test_the_census_records_a_process_of_the_run_with_its_import_time_and_not_one_outside_it(tmp_path):
    (tmp_path / "procs").mkdir()
    # -S: no site, so no census a measured run of this suite put in the virtualenv (it would record these
    # interpreters into its own records first); the module is read from the checkout.
    source = Path(process_census.__file__).parents[1]
    code = (f"import sys; sys.path.insert(0, {str(source)!r}); from kubetune_dev import process_census as c; "
            "c.install(sys.argv[1], int(sys.argv[2])); import json, email.mime.text")
    inside = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path), str(os.getpid())], check=True)
    outside = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path), "999999999"], check=True)
    assert inside.returncode == outside.returncode == 0
    [record] = read_processes(tmp_path)
    assert record.kind == "python -c" and record.cpu_s > 0 and record.import_s > 0 and record.import_cpu_s > 0
    assert process_census._descends_from(os.getpid()) and not process_census._descends_from(999999999)
