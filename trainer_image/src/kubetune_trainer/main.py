"""The trainer's entry: set up, train, save. Runs once per process under `accelerate launch`."""
from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from kubetune_api import layout
from kubetune_api.spec import TrainingJob, TrainingJobSpec
from kubetune_trainer import checkpoints
from kubetune_trainer.data.cache import EmbeddingCache, open_store
from kubetune_trainer.data.sampler import batches_per_epoch, check_enough_samples, epoch_batches
from kubetune_trainer.ema import EMA
from kubetune_trainer.families import family_for
from kubetune_trainer.loop import plan_steps, train
from kubetune_trainer.optim import PlateauScheduler, build_lr_scheduler, build_optimizer, set_optimizer_mode
from kubetune_trainer.profiling import maybe_profile
from kubetune_trainer.validation import Validator
from kubetune_trainer.reporting import Reporter
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.preemption import PREEMPTION_UPLOAD_SECONDS, Preempted, StopRequest
from kubetune_trainer.run_directory import RunPlace, local_start_checkpoint, place_run, run_id_from_env
from kubetune_trainer.storage import runs
from kubetune_trainer.storage.checkpoint_store import CheckpointStore, local_path_for
from kubetune_trainer.storage.uploader import UploadFailed
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


class EarlyStop(Exception):
    """Raised after a step whose validation ended the run (spec.validation.earlyStoppingPatience)."""


def open_cache(spec: TrainingJobSpec) -> EmbeddingCache | None:
    if not spec.data.cache.enabled:
        return None
    return EmbeddingCache(open_store(spec.data.cache.uri or f"{spec.checkpoints.uri.rstrip('/')}/cache"))


def fill_cache(accelerator, family, datasets, spec: TrainingJobSpec) -> None:
    """Encode this rank's share of every sample once (epoch 0's augmentations) into the cache."""
    from torch.utils.data import DataLoader

    for dataset in datasets:
        batch_size = min(spec.training.batch_size, len(dataset))
        batches = epoch_batches(len(dataset), batch_size, accelerator.num_processes, accelerator.process_index,
                                spec.training.seed, 0, getattr(dataset, "groups", None))
        for batch in DataLoader(dataset, batch_sampler=batches, collate_fn=family.collate):
            family.encode_batch(batch)


def agree_on_run_place(accelerator, spec: TrainingJobSpec, namespace: str, job_name: str) -> RunPlace:
    """The main process places the run; every process gets the same answer (or the same error)."""
    from accelerate.utils import broadcast_object_list

    decided: list = [None]
    if accelerator.is_main_process:
        try:
            decided[0] = place_run(spec.checkpoints, namespace, job_name, run_id_from_env())
        except ConfigError as err:
            decided[0] = err
    broadcast_object_list(decided)
    if isinstance(decided[0], ConfigError):
        raise decided[0]
    return decided[0]


def run(job: TrainingJob, cache_only: bool = False) -> Path | None:
    """Train the job to completion (or only fill the embedding cache); return the run's local directory."""
    from accelerate.utils import gather_object, set_seed

    spec = job.spec
    # The operator names the pod's TrainingJob; a local run goes by its manifest.
    namespace = os.environ.get("KUBETUNE_NAMESPACE") or job.metadata.namespace or "default"
    accelerator = setup_accelerator(spec)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    set_seed(spec.training.seed)
    # s3:// models and data are mirrored once per node; the other local processes then find them.
    with accelerator.local_main_process_first():
        spec = spec.model_copy(update={
            "model": spec.model.model_copy(update={"pretrained": local_copy(spec.model.pretrained)}),
            "data": spec.data.model_copy(update={"uri": local_copy(spec.data.uri)}),
            "adapter": spec.adapter.model_copy(update={
                "init_from": spec.adapter.init_from and local_copy(spec.adapter.init_from)}),
            "pmg": spec.pmg and spec.pmg.model_copy(update={
                "language_model": spec.pmg.language_model and local_copy(spec.pmg.language_model)}),
        })

    # Setup: model family, data, optimizer, schedule.
    family = family_for(spec.model.family)(spec, accelerator.device, WEIGHT_DTYPES[spec.training.mixed_precision])
    family.cache = open_cache(spec)
    dataset, held_out = family.build_datasets()
    if cache_only:
        if family.cache is None:
            raise ConfigError("--cache-only needs spec.data.cache.enabled: true")
        fill_cache(accelerator, family, [d for d in (dataset, held_out) if d is not None], spec)
        log.info("embedding cache filled: %d encoded, %d already there", family.cache.misses, family.cache.hits)
        accelerator.wait_for_everyone()
        return None
    world = accelerator.num_processes
    groups = getattr(dataset, "groups", None)
    check_enough_samples(len(dataset), spec.training.batch_size, world, groups)
    plan = plan_steps(spec.training, batches_per_epoch(len(dataset), spec.training.batch_size, world, groups))
    if spec.training.gradient_checkpointing:
        family.enable_gradient_checkpointing()
    optimizer = build_optimizer(family.trainable_parameters(), spec.training)
    scheduler = build_lr_scheduler(optimizer, spec.training, plan.total_steps)
    model, optimizer = accelerator.prepare(family.trainable_module, optimizer)
    if spec.training.compile:
        model = torch.compile(model)
    set_optimizer_mode(optimizer, training=True)
    ema = EMA(family.trainable_parameters(), spec.training.ema_decay) if spec.training.ema_decay else None
    if ema is not None:
        ema.attach(optimizer)
    # Where this run writes (its own version directory) and which checkpoint it starts from.
    place = agree_on_run_place(accelerator, spec, namespace, job.metadata.name)
    with accelerator.local_main_process_first():
        start_checkpoint = local_start_checkpoint(
            place, fetch=accelerator.is_local_main_process and not accelerator.is_main_process)
    output = local_path_for(place.uri)
    validator = Validator(spec, family, held_out, output, accelerator.is_main_process)
    # State beyond weights, optimizer and schedule that an exact resume needs.
    extra_state = {name: obj for name, obj in (("ema", ema), ("validation", validator)) if obj is not None}
    noise_generator = torch.Generator().manual_seed(spec.training.seed * 7919 + accelerator.process_index + 1)

    @contextmanager
    def weights_to_publish():
        """The weights a user gets: the EMA average, the schedule-free evaluation point."""
        set_optimizer_mode(optimizer, training=False)
        if ema is not None:
            ema.swap()
        try:
            yield
        finally:
            if ema is not None:
                ema.swap()
            set_optimizer_mode(optimizer, training=True)

    position = Position()
    if start_checkpoint is not None:
        family.load_trainable_state_dict(read_trainable(start_checkpoint))
        position = restore_state(start_checkpoint, accelerator.process_index, optimizer, scheduler,
                                 noise_generator)
        for name, obj in extra_state.items():
            obj.load_state_dict(torch.load(start_checkpoint / f"{name}.pt", weights_only=False))
        log.info("resumed from %s at step %d", place.start_from, position.step)

    def save_checkpoint(pos: Position, force: bool = False) -> None:
        if pos.step % spec.checkpoints.every_steps and pos.step != plan.total_steps and not force:
            return
        started = time.perf_counter()
        path = checkpoints.checkpoint_dir(output, pos.step)
        if accelerator.is_main_process and path.exists():
            shutil.rmtree(path)  # a partial save of the same step from a crashed attempt
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            save_main_state(path, family.trainable_state_dict(), optimizer, scheduler, pos)
            for name, obj in extra_state.items():
                torch.save(obj.state_dict(), path / f"{name}.pt")
            if spec.adapter.type == "lora":
                with weights_to_publish():
                    family.save_weights(path)  # the adapter in its standard format, ready to pull
        # Every rank's RNG goes to the main process, the checkpoint's single writer.
        rng_states = gather_object([capture_rng(noise_generator)])
        if accelerator.is_main_process:
            save_rng_states(path, rng_states)
            # Manifest (complete from then on) and upload: now for a local store, else in the background.
            size = store.publish_checkpoint(path, pos.step, pos.epoch, pos.loss, spec.checkpoints.keep_last)
            reporter.checkpoint_saved(pos.step, time.perf_counter() - started, size)
            record_run(pos.step)
            reporter.flush()
            store.mirror("logs")  # TensorBoard in S3 follows the checkpoints
        accelerator.wait_for_everyone()

    samples_per_step = spec.training.batch_size * spec.training.gradient_accumulation_steps * world
    reporter = Reporter(accelerator.is_main_process, plan.total_steps, position.step, output / "logs",
                        spec.training.log_every_steps, samples_per_step, namespace, job.metadata.name)
    reporter.pods(list(dict.fromkeys(gather_object([socket.gethostname()]))))
    reporter.run_version(place.version)
    store = CheckpointStore(place.uri, on_published=reporter.checkpoint_published,
                            on_pending=reporter.uploads_pending)
    run_id = run_id_from_env()
    if accelerator.is_main_process:
        store.fetch_folder("best")  # a restarted pod on another node keeps ranking against the same best K

    def record_run(steps: int, finished: bool = False) -> None:
        """run.json: how far the run got (a run that stops before runs.MIN_STEPS is cleaned up)."""
        if accelerator.is_main_process:
            store.write_text(layout.RUN_FILE, runs.run_record_text(run_id, steps, finished), required=finished)

    reporter.message("training %s: %d steps, %d process(es), %d samples", job.metadata.name,
                     plan.total_steps, world, len(dataset))

    def save_best(folder: Path) -> None:
        with weights_to_publish():
            family.save_weights(folder)

    stop_request = StopRequest().install()

    def preemption_agreed() -> bool:
        """Whether any process got SIGTERM: every process must take the last checkpoint together."""
        flag = torch.tensor(float(stop_request.requested()), device=accelerator.device)
        return accelerator.reduce(flag, reduction="sum").item() > 0

    def on_step_end(pos: Position) -> None:
        if preemption_agreed():
            with reporter.timed("checkpoint"):
                save_checkpoint(pos, force=True)
            raise Preempted(pos.step)
        if pos.step == runs.MIN_STEPS:
            record_run(pos.step)  # from now on the run is worth keeping
        if isinstance(scheduler, PlateauScheduler) and held_out is None:
            scheduler.observe(pos.loss)
        stop = False
        if validator.due(pos.step, plan.total_steps):
            with weights_to_publish(), reporter.timed("validation"):
                metrics = validator.run(accelerator.unwrap_model(model), pos.step, save_best)
            if accelerator.is_main_process:
                store.mirror("best")
                store.mirror("samples")
            if isinstance(scheduler, PlateauScheduler) and "loss" in metrics:
                scheduler.observe(metrics["loss"])
            stop = validator.should_stop
        with reporter.timed("checkpoint"):
            save_checkpoint(pos, force=stop)
        if stop:
            raise EarlyStop

    try:
        with maybe_profile(optimizer, spec.training.profile_steps, output / "profile", accelerator.is_main_process):
            train(accelerator, family, model, optimizer, scheduler, dataset, position, plan, reporter,
                  noise_generator, on_step_end)
    except EarlyStop:
        reporter.message("early stop: %s did not improve in %d validations", spec.validation.monitor,
                         spec.validation.early_stopping_patience)
    except BaseException:
        # Preempted or crashed: what is already saved should still reach the bucket, within the
        # pod's grace period (terminationGracePeriodSeconds leaves room for this).
        try:
            if not store.flush(timeout=PREEMPTION_UPLOAD_SECONDS):
                log.error("uploads still pending after %d s; the newest checkpoints stay local only",
                          PREEMPTION_UPLOAD_SECONDS)
        except UploadFailed as err:
            log.error("%s", err)
        reporter.close()
        store.close(wait=False)  # an upload still retrying must not hold the exit
        raise
    finally:
        validator.close()
    if family.cache is not None:
        reporter.message("embedding cache: %d hits, %d misses", family.cache.hits, family.cache.misses)

    if accelerator.is_main_process:
        with weights_to_publish():
            written = family.save_weights(output)
        reporter.close()  # flushes the TensorBoard events before they are uploaded
        extras = [p for folder in ("logs", "samples", "best", "profile") for p in (output / folder).rglob("*")]
        store.publish_files(written + sorted(p for p in extras if p.is_file()), "final weights and logs")
        record_run(position.step, finished=True)
        store.flush()  # raises if the final weights could not be uploaded
        log.info("final weights: %s", ", ".join(store_uri(store, p) for p in written))
    reporter.close()
    store.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return output
