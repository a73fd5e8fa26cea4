"""Where `make test`'s time goes: wall and CPU per test file and per test, the Python interpreters each
test started and their import time, control-plane starts, and each xdist worker's busy and idle time.

    .venv/bin/python benchmarks/test_time.py run  [--records DIR] [-- PYTEST ARGS]   # make test, measured
    .venv/bin/python benchmarks/test_time.py report --records DIR                     # print it again

`run` puts a `.pth` line into the virtualenv for the length of the run (every Python process then
records itself: kubetune_dev.process_census; a pod's environment is its own, so an environment
variable would not reach the pods), runs `make test` with the recording plugin
(kubetune_dev.test_time) and removes the line whatever happens. PYTEST ARGS replace the tests
`make test` would run (e.g. `-- tests/unit -n 2`), for a quicker look at one part.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devcluster" / "src"))
from kubetune_dev.test_time import RECORDS_VARIABLE, report  # noqa: E402  (the checkout's, before install)

CENSUS_PTH = "kubetune-test-time-census.pth"


def run(records: Path, pytest_args: list[str]) -> int:
    records = records.resolve()
    if records.exists() and any(records.iterdir()):
        sys.exit(f"{records} is not empty: give --records a new folder (records of two runs would mix)")
    (records / "procs").mkdir(parents=True)
    pth = Path(sysconfig.get_paths()["purelib"]) / CENSUS_PTH
    pth.write_text(f"import kubetune_dev.process_census as census; census.install({str(records)!r}, {os.getpid()})\n")
    env = {**os.environ, RECORDS_VARIABLE: str(records), "PYTHONUNBUFFERED": "1",
           "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -p kubetune_dev.test_time".strip()}
    started = time.monotonic()
    try:
        if pytest_args:
            command = [sys.executable, "-m", "pytest", *pytest_args]
        else:
            command = ["make", "test"]
        code = subprocess.run(command, cwd=REPO, env=env).returncode
    finally:
        pth.unlink(missing_ok=True)
    print(f"\n{' '.join(command)}: exit {code} after {time.monotonic() - started:.0f} s\n")
    print(report(records))
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["run", "report"])
    parser.add_argument("--records", type=Path, default=REPO / "out" / "test-time",
                        help="where the records go (a new folder for run)")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list")
    argv = sys.argv[1:]
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if args.mode == "report":
        print(report(args.records, top=args.top))
        return 0
    return run(args.records, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
