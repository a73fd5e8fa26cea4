"""The trainer's entry: set up, train, save. Runs once per process under `accelerate launch`."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJob, TrainingJobSpec
from kubetune_trainer import checkpoints
from kubetune_trainer.data.sampler import batches_per_epoch, check_enough_samples
from kubetune_trainer.families import family_for
from kubetune_trainer.loop import plan_steps, train
from kubetune_trainer.optim import build_lr_scheduler, build_optimizer
from kubetune_trainer.reporting import Reporter
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.checkpoint_store import CheckpointStore
from kubetune_trainer.storage.inputs import local_copy
from kubetune_trainer.training_state import (Position, capture_rng, read_trainable, restore_state,
                                             save_main_state, save_rng_states)

log = logging.getLogger("kubetune.trainer")
WEIGHT_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def store_uri(store: CheckpointStore, path: Path) -> str:
    """Where a file under the local checkpoint root ends up (its s3:// URI when mirrored)."""
    if store.remote is None:
        return str(path)
    return store.remote.child(str(path.relative_to(store.local))).uri


def setup_accelerator(spec: TrainingJobSpec):
    from accelerate import Accelerator

    use_gpu = spec.resources.gpus_per_node > 0 and torch.cuda.is_available()
    if spec.resources.gpus_per_node > 0 and not torch.cuda.is_available():
        log.warning("spec.resources.gpusPerNode is %d but no GPU is visible: training on the CPU",
                    spec.resources.gpus_per_node)
    if spec.training.mixed_precision == "fp16" and not use_gpu:
        raise ConfigError('spec.training.mixedPrecision: fp16 needs a GPU; use bf16 or "no" on the CPU')
    return Accelerator(mixed_precision=spec.training.mixed_precision, cpu=not use_gpu)


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def run(job: TrainingJob) -> Path:
    """Train the job to completion; return where the final weights are."""
    from accelerate.utils import gather_object, set_seed

    spec = job.spec
    accelerator = setup_accelerator(spec)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    set_seed(spec.training.seed)
    store = CheckpointStore(spec.checkpoints.uri)
    output = store.local
    # s3:// models and data are mirrored once per node; the other local processes then find them.
    with accelerator.local_main_process_first():
        spec = spec.model_copy(update={
            "model": spec.model.model_copy(update={"pretrained": local_copy(spec.model.pretrained)}),
            "data": spec.data.model_copy(update={"uri": local_copy(spec.data.uri)}),
        })
        if spec.checkpoints.resume_from == "latest" and accelerator.is_local_main_process:
            store.fetch_latest()

    # Setup: model family, data, optimizer, schedule.
    family = family_for(spec.model.family)(spec, accelerator.device, WEIGHT_DTYPES[spec.training.mixed_precision])
    dataset = family.build_dataset()
    world = accelerator.num_processes
    check_enough_samples(len(dataset), spec.training.batch_size, world)
    plan = plan_steps(spec.training, batches_per_epoch(len(dataset), spec.training.batch_size, world))
    optimizer = build_optimizer(family.trainable_parameters(), spec.training)
    scheduler = build_lr_scheduler(optimizer, spec.training, plan.total_steps)
    model, optimizer = accelerator.prepare(family.trainable_module, optimizer)
    noise_generator = torch.Generator().manual_seed(spec.training.seed * 7919 + accelerator.process_index + 1)

    position = Position()
    if spec.checkpoints.resume_from == "latest":
        latest = checkpoints.latest_complete(output)
        if latest is not None:
            family.load_trainable_state_dict(read_trainable(latest.path))
            position = restore_state(latest.path, accelerator.process_index, optimizer, scheduler,
                                     noise_generator)
            log.info("resumed from %s at step %d", latest.path, position.step)

    def save_checkpoint(pos: Position) -> None:
        if pos.step % spec.checkpoints.every_steps and pos.step != plan.total_steps:
            return
        path = checkpoints.checkpoint_dir(output, pos.step)
        if accelerator.is_main_process and path.exists():
            shutil.rmtree(path)  # a partial save of the same step from a crashed attempt
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            save_main_state(path, family.trainable_state_dict(), optimizer, scheduler, pos)
            if spec.adapter.type == "lora":
                family.save_weights(path)  # the adapter in its standard format, ready to pull
        # Every rank's RNG goes to the main process, the checkpoint's single writer.
        rng_states = gather_object([capture_rng(noise_generator)])
        if accelerator.is_main_process:
            save_rng_states(path, rng_states)
            checkpoints.write_manifest(path, pos.step, pos.epoch, pos.loss)
            checkpoints.prune(output, spec.checkpoints.keep_last)
            store.publish(path)
            store.prune(spec.checkpoints.keep_last)
        accelerator.wait_for_everyone()

    samples_per_step = spec.training.batch_size * spec.training.gradient_accumulation_steps * world
    reporter = Reporter(accelerator.is_main_process, plan.total_steps, position.step, output / "logs",
                        spec.training.log_every_steps, samples_per_step, job.metadata.name)
    reporter.message("training %s: %d steps, %d process(es), %d samples", job.metadata.name,
                     plan.total_steps, world, len(dataset))
    try:
        train(accelerator, family, model, optimizer, scheduler, dataset, position, plan, reporter,
              noise_generator, save_checkpoint)
    finally:
        reporter.close()

    if accelerator.is_main_process:
        written = family.save_weights(output)
        store.publish_files(written + sorted(p for p in (output / "logs").rglob("*") if p.is_file()))
        log.info("final weights: %s", ", ".join(store_uri(store, p) for p in written))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return output
