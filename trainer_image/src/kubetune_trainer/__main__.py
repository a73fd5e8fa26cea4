"""`python -m kubetune_trainer --config JOB.yaml`: what each training process runs."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kubetune_api.manifest import ManifestError, load_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="the TrainingJob manifest")
    parser.add_argument("--cache-only", action="store_true",
                        help="only encode every sample into spec.data.cache (a stage before training)")
    args = parser.parse_args(argv)
    try:
        job = load_manifest(args.config)
    except ManifestError as err:
        print(f"{args.config}: invalid\n{err}", file=sys.stderr)
        return 2
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.main import run
    from kubetune_trainer.preemption import RETRYABLE_EXIT_CODE, Preempted

    try:
        run(job, cache_only=args.cache_only)
    except (ConfigError, FileNotFoundError) as err:
        print(f"kubetune trainer: {err}", file=sys.stderr)
        return 2
    except Preempted as stop:
        print(f"kubetune trainer: {stop}", file=sys.stderr)
        return RETRYABLE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
