"""`python -m kubetune_trainer.results.generation_pod --run URI --step S --out URI ...`: a run's images drawn in a pod.

What `kubetune generate --on-cluster` asks for: the operator renders a batch Job running this in the
trainer image (kubetune_operator.generation_jobs), with the job's credentials. It draws what
`kubetune generate` draws on a workstation, with the same Generator: the TrainingJob the run trained
(its job.yaml), its weights at a step (or the base model, or both side by side), and writes the PNGs
(prompt, seed and step in their text chunks) and grid.png into --out, an s3:// folder beside the run.

A request it cannot draw ends with one line on stderr (also the pod's termination message, which
the Job's status shows) and exit code 1; nothing already in --out is overwritten.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import yaml

from kubetune_api import layout
from kubetune_trainer.process.termination import write_termination_message


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.results.generation_pod",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="the run's URI (.../<namespace>/<job>/v<N>)")
    parser.add_argument("--step", required=True, help="a checkpoint's step, final, or base (the base model alone)")
    parser.add_argument("--out", required=True, help="a new folder (s3:// or local) for the PNGs and grid.png")
    parser.add_argument("--compare", action="store_true", help="the base and the trained weights side by side")
    parser.add_argument("--prompt", dest="prompts", action="append", default=[])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--device", default=None, help="torch device (default: cuda when there is one)")
    return parser.parse_args(argv)


def read_trained_job(run_uri: str):
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.results.generation import GenerationError
    from kubetune_trainer.storage.tree import open_tree

    text = open_tree(run_uri).read_text(layout.JOB_FILE)
    if text is None:
        raise GenerationError(f"--run {run_uri} has no {layout.JOB_FILE}: not a run kubetune wrote")
    return TrainingJob.model_validate(yaml.safe_load(text))


def pull_weights(run_uri: str, step: str, folder: Path) -> None:
    """The run's final weights or checkpoint-STEP into FOLDER, verified as `kubetune checkpoints pull` does."""
    from kubetune_trainer.results.generation import GenerationError
    from kubetune_trainer.checkpoint.catalog import describe_run, pull_checkpoint, pull_final

    run = describe_run(run_uri, None)
    if step == "final":
        if not run.final_files:
            raise GenerationError(f"--step final: {run_uri} has no final weights (the run has not finished)")
        pull_final(run, folder)
        return
    entry = run.checkpoint(int(step))
    if entry is None:
        steps = ", ".join(str(c.step) for c in run.checkpoints) or "none"
        raise GenerationError(f"--step {step}: {run_uri} has no complete checkpoint-{step} (checkpoints: {steps})")
    pull_checkpoint(entry, folder)


def check_out_is_new(out: str) -> None:
    from kubetune_trainer.results.generation import GenerationError
    from kubetune_trainer.storage.tree import open_tree

    if open_tree(out).files():
        raise GenerationError(f"--out {out} already holds files: give a new folder (nothing was overwritten)")


def publish(folder: Path, out: str) -> None:
    """Every file of FOLDER into OUT (s3:// or a local folder)."""
    import shutil

    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import is_s3, parse_s3

    files = sorted(p for p in folder.iterdir() if p.is_file())
    if is_s3(out):
        s3.upload_files(files, folder, parse_s3(out))
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, Path(out) / path.name)


def draw(args: argparse.Namespace) -> str:
    import torch

    from kubetune_trainer.results.generation import Generator, Request, check_request, save_grid, save_images

    if args.step not in ("final", "base") and not args.step.isdigit():
        from kubetune_trainer.results.generation import GenerationError

        raise GenerationError(f"--step {args.step!r}: use a step number, final or base")
    check_out_is_new(args.out)
    job = read_trained_job(args.run)
    request = Request(prompts=tuple(args.prompts), steps=args.steps, guidance=args.guidance, seed=args.seed,
                      count=args.count)
    check_request(job.spec.model.family, request)
    generator = Generator(job, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    if args.step == "base" or args.compare:
        rows.append(generator.generate(request))
    if args.step != "base":
        step = int(args.step) if args.step.isdigit() else args.step
        with tempfile.TemporaryDirectory(prefix="kubetune-generate-") as weights:
            pull_weights(args.run, args.step, Path(weights))
            generator.load_weights(Path(weights), step)
        rows.append(generator.generate(request))
    with tempfile.TemporaryDirectory(prefix="kubetune-generated-") as folder:
        written = [path for row in rows for path in save_images(row, Path(folder))]
        save_grid(rows, Path(folder))
        publish(Path(folder), args.out)
    return f"wrote {len(written)} image(s) and grid.png into {args.out}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.results.generation import GenerationError
    from kubetune_trainer.checkpoint.catalog import PullFailed

    try:
        print(draw(args), flush=True)
        return 0
    except (GenerationError, ConfigError, PullFailed) as err:
        line = f"kubetune generate: {err}".splitlines()[0]
        print(line, file=sys.stderr, flush=True)
        write_termination_message(line)  # in the operator's pod: the Job's status shows it
        return 1


if __name__ == "__main__":
    sys.exit(main())
