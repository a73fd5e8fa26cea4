"""`kubetune export JOB --format diffusers|kohya|merged`: a run's weights in the form another tool loads.

JOB, --version and --step pick the weights as `kubetune checkpoints pull` does (kubetune_cli.trained);
the run's job.yaml says the family and the base model. The export is written into a hidden folder
beside --out and only then moved in, file by file, after every destination was checked: a failed
export leaves --out as it was, and nothing is written through a symbolic link.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import click

from kubetune_cli.runs import STEP_HELP, namespace_option, resolve, storage_errors, version_option
from kubetune_cli.trained import check_out_folder, check_step, choose_run, fail, pull_weights, read_job, resolve_step, step_label
from kubetune_trainer.checkpoint.catalog import human_size

COMMAND = "export"
FORMATS = ("diffusers", "kohya", "merged")
# What a checkpoint folder holds besides the family's weight files (the resumable training state).
CHECKPOINT_RECORDS = frozenset({"manifest.json", "validation.json", "trainer_state.json"})
CHECKPOINT_FOLDERS = frozenset({"state", "parts", "logs"})

HELP = """Export the trained weights of JOB (a TrainingJob name, or the URI of a job directory or a run)
in the form another tool loads.

\b
--format diffusers: the files the trainer wrote (pytorch_lora_weights.safetensors, which diffusers'
  load_lora_weights reads; Wan's second expert's file beside it), in --dtype, metadata kept.
  PMG: its adapter (pmg_adapter.safetensors and its config); the classifier: its model or PEFT
  adapter folder (save_pretrained), as they are.
--format kohya: the LoRA in the key names of the family's other tools: lora_unet_... for SD1.5 and
  SDXL (ComfyUI, kohya sd-scripts, A1111/Forge); diffusion_model.... for Qwen-Image, Qwen-Image-Edit(-Plus)
  and Z-Image (ComfyUI, musubi-tuner), and with Wan's own module names for Wan; lora_unet_ with
  BFL's module names (double_blocks_N_img_attn_qkv: q, k, v as one pair) for FLUX.1 Kontext, FLUX.2
  and FLUX.2 [klein] (ComfyUI, kohya sd-scripts). diffusers' load_lora_weights reads each. Refused
  for SD3.5 (no such convention diffusers reads), for PMG and the classifier (they train no
  diffusers LoRA), and for a full fine-tune.
--format merged: the base model (spec.model.pretrained of the run's job.yaml) with the LoRA fused
  in, or a full fine-tune's trained components in place of the base's: a whole diffusers pipeline
  folder for from_pretrained. Refused for PMG and the classifier.
"""


def lora_trained(definition, info, spec) -> bool:
    """A diffusers LoRA file is what the run wrote (not PMG's own parts, a classifier, a full fine-tune)."""
    return definition.pipeline is not None and not info.own_adapter and spec.adapter.type == "lora"


def formats_of(definition, info, spec) -> list[str]:
    formats = ["diffusers"]
    if lora_trained(definition, info, spec) and definition.kohya is not None:
        formats.append("kohya")
    if definition.pipeline is not None and not info.own_adapter:
        formats.append("merged")
    return formats


def refuse_format(format_: str, family: str, definition, info, spec) -> None:
    formats = formats_of(definition, info, spec)
    if format_ in formats:
        return
    if format_ == "kohya" and lora_trained(definition, info, spec):
        why = f"{family} has no kohya-style LoRA convention that diffusers also reads"
    elif format_ == "kohya" and spec.adapter.type == "full" and not info.own_adapter and definition.pipeline:
        why = "the run is a full fine-tune (spec.adapter.type full): there is no LoRA to convert"
    else:
        why = f"{family} trains no diffusers LoRA and has no diffusers pipeline to merge into"
    fail(COMMAND, f"--format {format_}: {why}; {family} exports as {' or '.join(formats)}")


def weight_files(folder: Path, step: int | str) -> list[Path]:
    """The family's weight files among what was pulled: all of the final weights; of a checkpoint,
    its top-level weights and configs and its model folders, not the training state."""
    if step == "final":
        return sorted(p for p in folder.rglob("*") if p.is_file())
    chosen = []
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix in (".safetensors", ".json") and entry.name not in CHECKPOINT_RECORDS:
            chosen.append(entry)
        elif entry.is_dir() and entry.name not in CHECKPOINT_FOLDERS and (entry / "config.json").is_file():
            chosen.extend(p for p in sorted(entry.rglob("*")) if p.is_file())
    return chosen


def move_into(staging: Path, out: Path, force: bool) -> list[Path]:
    """Every file of `staging` to the same place under `out`, once none of the places is a link or
    a folder (checked first, so a refusal leaves `out` untouched)."""
    from kubetune_trainer.storage.confine import UnsafePath, confined

    files = sorted(p for p in staging.rglob("*") if p.is_file())
    out.mkdir(parents=True, exist_ok=True)
    for file in files:
        name = file.relative_to(staging).as_posix()
        try:
            target = confined(out, name, "--out file")
        except UnsafePath as err:
            fail(COMMAND, str(err))
        if target.is_symlink() or target.is_dir():
            fail(COMMAND, f"--out {out}: {name} exists as a {'symbolic link' if target.is_symlink() else 'folder'}; "
                          "remove it or give another --out")
    from kubetune_trainer.checkpoint.catalog import move_into as move_checked

    # check_out_folder let a non-empty --out through only with --force; a file that appeared since
    # is still the user's: replaced only with --force.
    return move_checked(staging, out, force)


def local_models(spec):
    """The spec with spec.model.pretrained and spec.model.vae on this machine (s3:// ones downloaded
    as the trainer would): what the merged export loads."""
    from kubetune_trainer.run import looks_local
    from kubetune_trainer.storage.inputs import local_copy

    local = {}
    for field, source in (("pretrained", spec.model.pretrained), ("vae", spec.model.vae)):
        if source and looks_local(source) and not Path(source).expanduser().exists():
            fail(COMMAND, f"--format merged: {source} (spec.model.{field} of the run's job.yaml) is not on this "
                          "machine; run the export where it is")
        with storage_errors(source or ""):
            local[field] = source and local_copy(source)
    return spec.model_copy(update={"model": spec.model.model_copy(update=local)})


@click.command(COMMAND, help=HELP)
@click.argument("job")
@click.option("--format", "format_", type=click.Choice(FORMATS), required=True, help="What to write (see above).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Precision of the written weights; default: the run's (spec.adapter.saveDtype, else the "
                   "training precision).")
@click.option("--out", "out_path", type=click.Path(), default=None,
              help="Folder to write (created; must be empty unless --force); default "
                   "./<job>-v<N>-<step>-<format>.")
@click.option("--step", default="final", show_default=True, metavar="N|latest|final", help=STEP_HELP)
@version_option
@namespace_option
@click.option("--force", is_flag=True, help="Write into a non-empty --out, replacing files of the same names.")
def export(job: str, format_: str, dtype: str | None, out_path: str | None, step: str, version: int | None,
           namespace: str | None, force: bool) -> None:
    from kubetune_api.families import FAMILIES
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families import definition_for

    check_step(COMMAND, step)
    run = choose_run(COMMAND, resolve(job, namespace), version)
    chosen = resolve_step(COMMAND, run, step)
    trained = read_job(COMMAND, run)
    spec, family = trained.spec, trained.spec.model.family
    try:
        definition = definition_for(family)
    except ConfigError as err:
        fail(COMMAND, f"{run.uri}: {err}")
    refuse_format(format_, family, definition, FAMILIES[family], spec)
    label = "final" if chosen == "final" else f"step{chosen}"
    out = Path(out_path) if out_path else Path(f"{trained.metadata.name}-v{run.version}-{label}-{format_}")
    check_out_folder(COMMAND, out, force)
    dtype = dtype or spec.save_dtype

    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kubetune-export-", dir=out.absolute().parent) as scratch:
        pulled, staging = Path(scratch) / "pulled", Path(scratch) / "export"
        staging.mkdir()
        pull_weights(run, chosen, pulled)
        write(format_, definition, spec, trained.metadata.name, run, chosen, pulled, staging, dtype)
        written = move_into(staging, out, force)
    size = sum(p.stat().st_size for p in written)
    click.echo(f"exported {step_label(chosen)} of {run.uri} as {format_} ({dtype}; {len(written)} files, "
               f"{human_size(size)}) into {out}")


def write(format_: str, definition, spec, name: str, run, step: int | str, pulled: Path, staging: Path,
          dtype: str) -> None:
    from kubetune_trainer.results import export as exporting
    from kubetune_trainer.results.lora_keys import UnconvertibleLora

    torch_dtype = exporting.DTYPES[dtype]
    files = weight_files(pulled, step)
    if not files:
        fail(COMMAND, f"--step {step}: {step_label(step)} of {run.uri} holds no weight files (a full fine-tune's "
                      "checkpoints hold only the training state): export --step final")
    if format_ == "diffusers":
        exporting.write_diffusers(pulled, files, staging, torch_dtype)
    elif format_ == "kohya":
        lora = exporting.lora_files(definition, pulled)
        if not lora:
            fail(COMMAND, f"{step_label(step)} of {run.uri} holds no LoRA file")
        names = {source: source.replace("pytorch_lora_weights", name) for source in lora}
        try:
            exporting.write_kohya(pulled, names, definition.kohya, staging, torch_dtype,
                                  {"run": run.uri, "step": str(step), "family": spec.model.family})
        except UnconvertibleLora as err:
            fail(COMMAND, f"--format kohya: {step_label(step)} of {run.uri}: {err}")
    else:
        exporting.write_merged(definition, local_models(spec), pulled, staging, torch_dtype)
