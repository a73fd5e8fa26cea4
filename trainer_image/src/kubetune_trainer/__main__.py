"""`python -m kubetune_trainer --config JOB.yaml`: what each training process runs.

Exit codes say what a restart policy should do: 0 done; 2 the job itself is wrong (retrying
cannot help); 3 training diverged (a retry would diverge again at the same step); 143 stopped (SIGTERM/SIGINT, or another process of the job stopped) after saving
what there was to save — retry, the run resumes from its checkpoint; anything else: a failure.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kubetune_trainer.process.exit_answer import exit_answer
from kubetune_trainer.process.parent_watch import watch_launcher
from kubetune_trainer.process.preemption import CONFIG_ERROR_EXIT_CODE, StopRequest


def main(argv: list[str] | None = None) -> int:
    # First of all: a stop request while models load must end the process, not wait for SIGKILL.
    stop = StopRequest().install()
    watch_launcher()  # and a launcher killed outright stops this process the same way (SIGTERM)
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="the TrainingJob manifest")
    parser.add_argument("--cache-only", action="store_true",
                        help="only encode every sample into spec.data.cache (a stage before training)")
    parser.add_argument("--detect-anomaly", action="store_true",
                        help="autograd anomaly detection: a NaN or inf names the operation that made it (slow; "
                             "`kubetune train --debug` sets it)")
    args = parser.parse_args(argv)
    if args.detect_anomaly:
        import torch

        torch.autograd.set_detect_anomaly(True)
        print("kubetune trainer: debug: autograd anomaly detection is on", file=sys.stderr)
    try:
        from kubetune_api.manifest import ManifestError, load_manifest

        try:
            job = load_manifest(args.config)
        except ManifestError as err:
            print(f"{args.config}: invalid\n{err}", file=sys.stderr)
            return CONFIG_ERROR_EXIT_CODE
        from kubetune_trainer.run import Run

        Run(job, stop).execute(cache_only=args.cache_only)
    except Exception as err:
        found = exit_answer(err, stop)  # the one place that decides (the models stage asks it too)
        if found is None:
            raise  # a bug: its traceback is what a report needs
        print(f"kubetune trainer: {found.message}", file=sys.stderr)
        return found.code
    finally:
        stop.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
