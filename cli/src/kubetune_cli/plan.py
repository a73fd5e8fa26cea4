"""`kubetune plan`: will the job fit its GPUs? Per-GPU memory from the real architecture.

The models are built from the config files under spec.model.pretrained on the meta device (no
weights are read, nothing is allocated), and the family's training forward runs on fake tensors
to measure the activations; see kubetune_trainer.planning. torch is imported only here, inside
the command, so `kubetune validate` stays light.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import warnings
from pathlib import Path

import click

from kubetune_api.failures import BAD_INPUT
from kubetune_api.manifest import ManifestError, load_manifest
from kubetune_api.strategy import unsharded_note

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0


def gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


def millions(count: int) -> str:
    return f"{count / 1e6:,.1f}M" if count >= 1e5 else f"{count:,}"


def render_text(name: str, spec, plan) -> str:
    """The plan as a short report: what holds memory, the total against the GPU, and fixes."""
    e = plan.estimate
    unit = "GPU" if e.device == "cuda" else "process (CPU)"
    lines = [
        f"{name}: {spec.model.family} {spec.adapter.type}"
        + (f" rank {spec.adapter.rank}" if spec.adapter.type == "lora" else "")
        + f", {f'{spec.size[0]}x{spec.size[1]} px' if spec.size else 'the model image size'}, batch {spec.training.batch_size}, {spec.training.mixed_precision} precision, "
        f"{spec.training.optimizer}, {e.strategy} over {e.world_size} process(es)",
        f"per {unit}:",
        f"  parameters        {millions(e.parameters)} ({millions(e.trainable_parameters)} trained)",
        f"  weights           {gib(e.weights):>11}   "
        + ", ".join(f"{model} {gib(size)}" for model, size in e.weights_by_model.items()),
        f"  gradients         {gib(e.gradients):>11}",
        f"  optimizer state   {gib(e.optimizer):>11}   ({spec.training.optimizer})",
        f"  EMA               {gib(e.ema):>11}",
        f"  activations       {gib(e.activations):>11}   saved for backward"
        + (" (gradient checkpointing)" if spec.training.gradient_checkpointing else ""),
        f"  working memory    {gib(max(e.backward_working, e.step_working)):>11}   at the peak ({e.peak_phase})",
    ]
    if e.overhead:
        lines.append(f"  CUDA overhead     {gib(e.overhead):>11}   context, workspaces, allocator slack")
    if e.host:
        lines.append(f"  in CPU memory     {gib(e.host):>11}   (not counted above: see the notes)")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  total             {gib(e.total):>11}   {verdict} in {gib(plan.capacity)}")
    unsharded = unsharded_note(spec, e.world_size)
    lines += [f"note: {note}" for note in (*e.notes, *([unsharded] if unsharded else []))]
    if not plan.fits:
        if plan.suggestions:
            lines.append("what would fit (each estimated again):")
            for fix in plan.suggestions:
                sets = " ".join(f"--set {o}" for o in fix.overrides)
                lines.append(f"  - {fix.description}: {gib(fix.estimate.total)} per GPU   {sets}")
        else:
            lines.append("nothing suggested fits: lower spec.data.resolution or spec.training.batchSize, or use "
                         "GPUs with more memory")
    return "\n".join(lines)


def render_json(name: str, plan) -> dict:
    """The plan with camelCase keys, as the rest of the API spells them."""
    from dataclasses import asdict

    from pydantic.alias_generators import to_camel

    def estimate(e) -> dict:
        return {**{to_camel(key): value for key, value in asdict(e).items()},
                "total": e.total, "peakPhase": e.peak_phase}

    return {"name": name, "fits": plan.fits, "gpuMemoryBytes": plan.capacity, "estimate": estimate(plan.estimate),
            "suggestions": [{"description": s.description, "overrides": list(s.overrides),
                             "estimate": estimate(s.estimate)} for s in plan.suggestions]}


@contextlib.contextmanager
def _quiet_libraries():
    """Silence the model libraries' notices (optional kernels, loading real weights: none of which
    a plan uses) while planning, and give logging and warnings back afterwards (a plan may run
    inside a longer-lived process, e.g. a test session)."""
    previous_disable = logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # torch, diffusers and transformers log through logging
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                import diffusers  # noqa: F401  (prints notices about optional kernels on import)
                import peft  # noqa: F401
                import transformers  # noqa: F401
            yield
        finally:
            logging.disable(previous_disable)


@click.command()
@click.option("-f", "--filename", "path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The TrainingJob manifest, the same file you would `kubectl apply`.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
              help="Override a field, e.g. --set spec.training.batchSize=2 (repeatable).")
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True, max=4096), default=None,
              help=f"Memory of one GPU in GiB; default: spec.resources.gpuMemory, else {DEFAULT_GPU_MEMORY_GIB:g}.")
@click.option("--nodes", type=click.IntRange(1, 1024), default=None, help="Override spec.resources.nodes.")
@click.option("--gpus-per-node", type=click.IntRange(1, 16), default=None,
              help="Override spec.resources.gpusPerNode.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Estimate for this device; default: cuda when the job requests GPUs, else cpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(path: str, overrides: tuple[str, ...], gpu_memory_gib: float | None, nodes: int | None,
         gpus_per_node: int | None, device: str | None, as_json: bool) -> None:
    """Estimate per-GPU memory of a job (weights, gradients, optimizer, activations) and whether it fits."""
    layout = ((f"spec.resources.nodes={nodes}",) if nodes else ()) + (
        (f"spec.resources.gpusPerNode={gpus_per_node}",) if gpus_per_node else ())
    try:
        job = load_manifest(Path(path), (*overrides, *layout))
    except ManifestError as err:
        click.echo(f"{path}: invalid\n{err}", err=True)
        sys.exit(BAD_INPUT)
    capacity = gpu_memory_bytes(job.spec, gpu_memory_gib)
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.planning import plan_job

    try:
        with _quiet_libraries():
            result = plan_job(job.spec, capacity, device=device)
    except ConfigError as err:
        click.echo(f"{path}: cannot plan: {err}", err=True)
        sys.exit(BAD_INPUT)
    if as_json:
        click.echo(json.dumps(render_json(job.metadata.name, result), indent=2))
    else:
        click.echo(render_text(job.metadata.name, job.spec, result))


def gpu_memory_bytes(spec, gpu_memory_gib: float | None) -> int:
    """--gpu-memory-gib, else the job's spec.resources.gpuMemory, else 80 GiB (the operator's default)."""
    from kubetune_api.fit import gpu_memory

    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB)
    return gpu_memory(spec, f"{DEFAULT_GPU_MEMORY_GIB:g}Gi")
