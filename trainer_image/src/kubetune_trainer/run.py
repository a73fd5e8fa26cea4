"""One training run, as one process of it sees it: set up, place, resume, train, checkpoint,
publish, or abort.

Every process of the job runs the same phases in the same order; the collectives between them
(agreeing on a stop, gathering shards, checkpointing together) sit at the same points. Only the
main process (rank 0) writes what there is one of: run.json, the manifest, the final weights,
logs and metrics.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from kubetune_api import layout
from kubetune_api.contract import TrainerEnv, TrainerLog
from kubetune_api.quantity import parse_quantity
from kubetune_api.spec import TrainingJob, TrainingJobSpec
from kubetune_api.strategy import resolve_strategy, unsharded_note
from kubetune_trainer.training.attention import choose_attention
from kubetune_trainer.checkpoint import files as checkpoints, runs, training_state
from kubetune_trainer.checkpoint.resume import claim_run, local_start_checkpoint, place_run, run_id_from_env
from kubetune_trainer.checkpoint.sharded import ShardedState, files_of_rank, full_trained_state
from kubetune_trainer.checkpoint.store import CheckpointStore, local_path_for
from kubetune_trainer.checkpoint.training_state import Position, SavedState
from kubetune_trainer.training.compilation import CompileTimer, compile_regions
from kubetune_trainer.training.consistency import check_replicas_agree
from kubetune_trainer.data.cache import EmbeddingCache, open_store
from kubetune_trainer.data.sampler import Batching, check_enough_samples, epoch_steps, shard_for_encoding, steps_per_epoch
from kubetune_trainer.data.screening import image_paths
from kubetune_trainer.training.ema import EMA
from kubetune_trainer.errors import ConfigError, InputsInFlux, TrainingDiverged
from kubetune_trainer.families import family_for
from kubetune_trainer.loop import SampleLog, Stepper, iterate_steps, plan_steps, step_micro_batches
from kubetune_trainer.telemetry.phase_clock import PhaseClock
from kubetune_trainer.training.optim import (PlateauScheduler, build_lr_scheduler, build_optimizer, follow_spec_after_resume,
                                    set_optimizer_mode)
from kubetune_trainer.training.parallel import build_parallel
from kubetune_trainer.training.placement import use_channels_last
from kubetune_trainer.process.preemption import PREEMPTION_UPLOAD_SECONDS, Preempted, StopRequest
from kubetune_trainer.telemetry.profiling import maybe_profile
from kubetune_trainer.telemetry.reporting import Reporter
from kubetune_trainer.models.hub_stage import hub_locations
from kubetune_trainer.storage.inputs import local_copy, origin, version_of
from kubetune_trainer.storage.members import MEMBERS
from kubetune_trainer.storage.stream import Prefetcher, open_stream, streamed
from kubetune_trainer.storage.uri import is_s3
from kubetune_trainer.storage.uploader import UploadFailed
from kubetune_trainer.telemetry.step_readout import StepReadout, StepResult
from kubetune_trainer.telemetry.tracking import ABORT_SECONDS, tracker_for
from kubetune_trainer.results.validation import Validator

log = logging.getLogger("kubetune.trainer")
WEIGHT_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VALIDATION_FILE = "validation.json"


class EarlyStop(Exception):
    """Raised after a step whose validation ended the run (spec.validation.earlyStoppingPatience)."""


def setup_accelerator(spec: TrainingJobSpec):
    """Accelerate's process state: the process group, the device, autocast for mixed precision."""
    from accelerate import Accelerator

    gpus = spec.resources.gpus_per_node
    if gpus > 0 and not torch.cuda.is_available():
        raise ConfigError(
            f"spec.resources.gpusPerNode is {gpus} but this process sees no GPU (torch.cuda.is_available() is "
            "false): check the node's GPU driver and device plugin, or set spec.resources.gpusPerNode: 0 to "
            "train on the CPU")
    if spec.training.mixed_precision == "fp16" and not gpus:
        raise ConfigError('spec.training.mixedPrecision: fp16 needs a GPU; use bf16 or "no" on the CPU')
    return Accelerator(mixed_precision=spec.training.mixed_precision, cpu=not gpus)


def quiet_libraries() -> None:
    """No progress bars or info logs of diffusers and transformers: the trainer logs what it loads."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def with_local_inputs(spec: TrainingJobSpec, hub: dict[str, str] | None = None) -> TrainingJobSpec:
    """The spec with s3:// models and data replaced by this node's copies of them (the data by its
    streamed tree unless spec.data.streaming says to copy it whole). hub: where the job's hub
    models were placed, by field (kubetune_trainer.models.hub_stage): their mirror or snapshot instead."""
    placed = hub or {}
    data = spec.data.uri
    data = open_stream(data) if is_s3(data) and spec.data.streaming.enabled else local_copy(data)
    pretrained = placed.get("spec.model.pretrained", spec.model.pretrained)
    vae = placed.get("spec.model.vae", spec.model.vae)
    clip_model = placed.get("spec.validation.clipModel", spec.validation.clip_model)
    return spec.model_copy(update={
        "model": spec.model.model_copy(update={"pretrained": local_copy(pretrained), "vae": vae and local_copy(vae)}),
        "data": spec.data.model_copy(update={"uri": data}),
        "adapter": spec.adapter.model_copy(update={
            "init_from": spec.adapter.init_from and local_copy(spec.adapter.init_from)}),
        "pmg": spec.pmg and spec.pmg.model_copy(update={
            "language_model": spec.pmg.language_model and local_copy(spec.pmg.language_model)}),
        "validation": spec.validation.model_copy(update={
            "clip_model": clip_model and local_copy(clip_model)}),
    })


def looks_local(uri: str) -> bool:
    """A local path rather than a model-hub id (org/name): absolute, ./ ../ ~ relative."""
    return uri.startswith(("/", "./", "../", "~")) or uri in (".", "..")


def check_local_inputs(spec: TrainingJobSpec) -> None:
    """A local model path that is not there is named as such (from_pretrained would try the hub
    and report a network or repository-id error instead)."""
    named = {"spec.model.pretrained": spec.model.pretrained, "spec.model.vae": spec.model.vae,
             "spec.adapter.initFrom": spec.adapter.init_from,
             "spec.pmg.languageModel": spec.pmg and spec.pmg.language_model,
             "spec.validation.clipModel": spec.validation.clip_model}
    for field, uri in named.items():
        if uri and looks_local(uri) and not Path(uri).expanduser().exists():
            raise ConfigError(f"{field}: {uri} does not exist (a local path; a hub id reads org/name)")


def check_model_folder(spec: TrainingJobSpec) -> None:
    """A local spec.model.pretrained's config files, checked before the family loads them (model_folder)."""
    from kubetune_trainer.families import definition_for
    from kubetune_trainer.models.model_folder import check_configs, check_readable, model_folder

    uri = spec.model.pretrained
    if not looks_local(uri):
        return
    root = model_folder(uri, "spec.model.pretrained")
    check_readable(root, "spec.model.pretrained")
    subfolders = {component.subfolder for component in definition_for(spec.model.family).architecture.values()}
    check_configs(root, sorted(subfolders))


def images_of(dataset, keys: list) -> list[Path]:
    """The image files of a batch's samples (keys (epoch, index) into a keyed data set)."""
    return [path for _, index in keys for path in image_paths(dataset.samples[index])]


def open_cache(spec: TrainingJobSpec) -> EmbeddingCache | None:
    if not spec.data.cache.enabled:
        return None
    return EmbeddingCache(open_store(spec.data.cache.uri or f"{spec.checkpoints.uri.rstrip('/')}/cache"))


class Run:
    def __init__(self, job: TrainingJob, stop: StopRequest):
        self.job, self.spec, self.stop = job, job.spec, stop
        # The operator names the pod's TrainingJob; a local run goes by its manifest.
        self.namespace = TrainerEnv.from_env(os.environ).namespace or job.metadata.namespace or "default"
        self.run_id = run_id_from_env()

    # --- phases ---------------------------------------------------------------------------------

    def execute(self, cache_only: bool = False) -> Path | None:
        """The whole run; returns its local directory (None for --cache-only)."""
        self.set_up()
        self.stop.check()
        if cache_only:
            self.fill_cache()
            return None
        self.place()
        self.stop.check()
        self.resume()
        self.stop.check()
        try:
            self.train()
        except EarlyStop:
            self.reporter.message("early stop: %s did not improve in %d validations", self.spec.validation.monitor,
                                  self.spec.validation.early_stopping_patience)
        except BaseException:
            self.abort()
            raise
        finally:
            self.validator.close()
            self._stop_streaming()
        return self.publish()

    def set_up(self) -> None:
        """The process group, the family's models and data."""
        from accelerate.utils import set_seed

        self.accelerator = setup_accelerator(self.spec)
        logging.basicConfig(level=logging.INFO if self.is_main else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_libraries()
        log.info("attention: %s", choose_attention(self.spec.training.attention, self.accelerator.device))
        set_seed(self.spec.training.seed)
        # s3:// models and data are mirrored once per node; the node's other processes then find them.
        with self.accelerator.local_main_process_first():
            self.spec = with_local_inputs(self.spec, hub_locations(self.job))
        check_local_inputs(self.spec)
        check_model_folder(self.spec)
        dtype = WEIGHT_DTYPES[self.spec.training.mixed_precision]
        log.info("loading %s from %s (%d process(es), %d CPU thread(s) each)", self.spec.model.family,
                 self.spec.model.pretrained, self.world_size, torch.get_num_threads())
        self.family = family_for(self.spec.model.family)(self.spec, self.accelerator.device, dtype)
        if self.family.encoder_device != self.accelerator.device:
            log.info("frozen encoders (%s) on the CPU between validations: spec.model.encoderDevice %s%s",
                     ", ".join(self.family.frozen_models()), self.spec.model.encoder_device,
                     " (the embedding cache feeds the training steps)" if self.spec.data.cache.enabled else "")
        self.family.cache = open_cache(self.spec)
        samples = self.family.read_samples()
        self.prefetcher = None
        streaming = streamed(Path(self.spec.data.uri))
        if streaming:  # images are checked as they arrive (data.keyed)
            self.prefetcher = Prefetcher(
                int(parse_quantity(self.spec.data.streaming.cache_size, "spec.data.streaming.cacheSize")),
                self.spec.data.streaming.prefetch_steps, first_step_alone=True)
        if not streaming or self.family.layout.screen_streamed(self.spec):
            # Every file is checked before the first step (streamed clips where the sampler needs
            # them: from their headers); the processes share the work.
            size = self.family.size
            samples = self.family.screen.images(samples, self.rank, self.world_size, self._gather_objects, size,
                                                by_area=self.spec.data.bucketing)
            if self.family.screen.small is not None:
                log.warning("%s", self.family.screen.small.warning(size))
        for problem in self.family.screen.skipped[:20]:
            log.warning("skipped %s", problem)
        self.dataset, self.held_out = self.family.build_datasets(samples)

    def fill_cache(self) -> None:
        """--cache-only: encode this process's share of every sample once (epoch 0's augmentations).
        A streamed data set is fetched batch by batch ahead of the encoder and each batch's images
        are evicted once encoded, so this stage too keeps within spec.data.streaming.cacheSize."""
        from torch.utils.data import DataLoader

        if self.family.cache is None:
            raise ConfigError("--cache-only needs spec.data.cache.enabled: true")
        self.family.place_frozen(self.accelerator.device)  # filling the cache is what the encoders are for
        try:
            for dataset in (d for d in (self.dataset, self.held_out) if d is not None):
                batches = shard_for_encoding(len(dataset), self.spec.training.batch_size, self.world_size, self.rank,
                                             getattr(dataset, "groups", None))
                if self.prefetcher is not None:
                    self.prefetcher.plan([images_of(dataset, keys) for keys in batches])
                for batch in DataLoader(dataset, batch_sampler=batches, collate_fn=self.family.collate):
                    self.stop.check()
                    self.family.encode_batch(batch)
                    if self.prefetcher is not None:
                        self.prefetcher.advance()
        finally:
            self._stop_streaming()
        log.info("embedding cache filled: %d encoded, %d already there", self.family.cache.misses,
                 self.family.cache.hits)
        self.accelerator.wait_for_everyone()

    def place(self) -> None:
        """Where the run writes, what it starts from, how it batches and shards; refuse what cannot
        work before the run writes anything (its version is claimed last)."""
        self.run_place = self._agree(lambda: place_run(self.spec.checkpoints, self.namespace, self.job.metadata.name,
                                                       self.run_id))
        with self.accelerator.local_main_process_first():
            self.start_checkpoint = local_start_checkpoint(
                self.run_place, fetch=self.accelerator.is_local_main_process and not self.is_main)
        self.saved = training_state.read_saved_state(self.start_checkpoint) if self.start_checkpoint else None
        self.base_model = self._base_model_version()
        self.batching = self._batching()
        groups = getattr(self.dataset, "groups", None)
        check_enough_samples(len(self.dataset), self.batching.global_batch, groups)
        self.plan = plan_steps(self.spec.training, steps_per_epoch(len(self.dataset), self.batching.global_batch, groups))
        self._prepare_model()
        if self.start_checkpoint is not None:
            self.sharded.check_compatible(self.start_checkpoint)
        self._agree(lambda: claim_run(self.run_place, self.run_id, self.job))
        self.output = local_path_for(self.run_place.uri)
        self.last_validation: dict | None = None  # {step, metrics}: goes into each checkpoint's manifest
        self.validator = Validator(self.spec, self.family, self.held_out, self.output, self.is_main,
                                   sharded=self.parallel.sharded, from_main=self._agree,
                                   on_samples=lambda step, files: self.reporter.samples(files, self.output))
        self.store = CheckpointStore(self.run_place.uri, on_published=self._published, on_pending=self._pending,
                                     rank=self.rank, world_size=self.world_size)

    def resume(self) -> None:
        """Put the run back where its starting checkpoint left it (or start at step 0)."""
        self.position = Position()
        if self.start_checkpoint is not None:
            path, saved = self.start_checkpoint, self.saved
            self.sharded.load(path)
            self.scheduler.load_state_dict(torch.load(path / training_state.SCHEDULER_FILE, weights_only=False))
            follow_spec_after_resume(self.optimizer, self.scheduler, self.spec.training)
            if (path / VALIDATION_FILE).is_file():
                self.validator.load_state_dict(json.loads((path / VALIDATION_FILE).read_text()))
            self.position = training_state.continue_position(saved.position, saved.global_batch,
                                                             self.batching.global_batch)
            training_state.load_rng(path, self.rank, same_world=saved.world_size == self.world_size)
        self.reporter = Reporter(self.is_main, self.plan.total_steps, self.position.step, self.output / "logs",
                                 self.spec.training.log_every_steps, self.batching.global_batch, self.namespace,
                                 self.job.metadata.name, tracker=self._tracker())
        pod = TrainerEnv.from_env(os.environ).pod_name or socket.gethostname()  # the operator names the pod
        self.reporter.pods(list(dict.fromkeys(self._gather_objects(pod))))
        self.reporter.samples_skipped(len(self.family.screen.skipped))
        self.reporter.run_version(self.run_place.version)
        if self.is_main:
            self.store.fetch_folder("best")  # a restarted pod on another node ranks against the same best K
        if self.start_checkpoint is not None:
            self.reporter.message("resumed from %s at step %d", self.run_place.start_from, self.position.step)
            if (self.run_place.start_from or "").startswith(self.run_place.uri + "/"):
                self.reporter.resumed_own_checkpoint(self.position.step)
            self._explain_resume(self.saved)
        self.reporter.message("training %s: %d steps, %d process(es) (%s), %s, %d samples", self.job.metadata.name,
                              self.plan.total_steps, self.world_size, self.parallel.describe(),
                              self.batching.describe(), len(self.dataset))

    def train(self) -> None:
        """Optimizer steps until the plan is done; a stop request ends it at a step boundary."""
        self.stop.defer()  # from now on a SIGTERM waits for the step boundary
        if self.is_main:
            from kubetune_trainer.results.run_report import import_in_background

            import_in_background()  # the report written as the run ends needs them
        self._cache_seen = (0, 0) if self.family.cache is None else (self.family.cache.hits, self.family.cache.misses)
        self._validate_base()
        clock = PhaseClock(self.reporter, self.accelerator.device)
        stepper = Stepper(self.family, self.model, self.optimizer, self.scheduler, self.parallel, self.batching,
                          self.spec.training, clock)
        self.readout = StepReadout(self.accelerator.device, self.batching.global_batch, self._gather_rows)
        self._stop_seen = False
        compile_timer = CompileTimer(self.compiled)
        sample_log = SampleLog(self.rank)
        with maybe_profile(self.optimizer, self.spec.training.profile_steps, self.output / "profile", self.is_main):
            while self.position.step < self.plan.total_steps:
                steps = self._epoch_steps()[self.position.steps_in_epoch:]
                micro = step_micro_batches(steps, self.batching, self.rank)
                if self.prefetcher is not None:  # this rank's images, from where the run stands to its end
                    remaining = self.plan.total_steps - self.position.step
                    self.prefetcher.plan([self._images_of(step) for step in micro[:remaining]])
                for micro_batches in iterate_steps(self.dataset, self.family.collate, self.spec.data.num_workers,
                                                   micro, self.spec.training.seed + self.position.epoch):
                    sample_log.record(self.position.step, micro_batches)
                    compile_timer.step_started()
                    loss_sum, lr = stepper.step(self.position.step, micro_batches)
                    if self.prefetcher is not None:
                        self.prefetcher.advance()
                    self.position.step += 1
                    self.position.steps_in_epoch += 1
                    self.readout.push(self.position.step, self.position.epoch, lr, loss_sum, self.stop.requested())
                    self._after_step()
                    if (compiled := compile_timer.step_done()) is not None:
                        self.reporter.message(compiled)
                    clock.restart()  # checkpointing and validation were charged to their own phases
                    if self.position.step >= self.plan.total_steps:
                        clock.flush()
                        if self.position.steps_in_epoch == self.plan.steps_per_epoch:
                            self._epoch_done()
                        return
                self._epoch_done()
                self.position.epoch += 1
                self.position.steps_in_epoch = 0

    def save_checkpoint(self, force: bool = False) -> None:
        """Every process stages its share together; writing, hashing, uploading and the manifest
        follow in the background (checkpoint.store)."""
        pos = self.position
        if not (force or self._checkpoint_due()):
            return
        started = time.perf_counter()
        path = checkpoints.checkpoint_dir(self.output, pos.step)
        if self.accelerator.is_local_main_process and path.exists():
            shutil.rmtree(path)  # a partial save of the same step from a crashed attempt
        self.accelerator.wait_for_everyone()
        if not self.parallel.sharded:
            check_replicas_agree(self._trained_named(), self._gather_tensors)
        saving = self.sharded.save(path)
        publishable = self.family.trainable.publishable  # an adapter, not a whole model
        trained = self._trained_to_publish() if publishable else {}  # whole adapter, ready to pull
        training_state.save_rng(path, self.rank)
        if self.is_main:
            saved = SavedState(pos, self.batching.global_batch, self.world_size, self.spec.training.batch_size,
                               self.spec.training.gradient_accumulation_steps, self.parallel.describe(),
                               self.base_model)
            (path / training_state.STATE_FILE).write_text(saved.to_json())
            torch.save(self.scheduler.state_dict(), path / training_state.SCHEDULER_FILE)
            (path / VALIDATION_FILE).write_text(json.dumps(self.validator.state_dict()))
            if publishable:
                self.family.save_weights(path, trained)
        self.reporter.checkpoint_saved(pos.step, time.perf_counter() - started)
        self.store.publish_part(path, pos.step, lambda: files_of_rank(path, self.rank, self.world_size),
                                written=saving.result)
        if self.is_main:
            self.store.complete_checkpoint(path, pos.step, pos.epoch, pos.loss, self.spec.checkpoints.keep_last,
                                           self.last_validation)
            self._record_run(pos.step)
            self.reporter.flush()
            self.store.mirror("logs")  # TensorBoard in S3 follows the checkpoints

    def publish(self) -> Path:
        """The final weights in the family's format, logs and run.json: written, then uploaded."""
        output = self.output
        trained = self._trained_to_publish()
        if self.family.cache is not None:
            self.reporter.message("embedding cache: %d hits, %d misses", self.family.cache.hits,
                                  self.family.cache.misses)
        self.sharded.wait()
        if self.is_main:
            written = self.family.save_weights(output, trained)
            self.reporter.final_weights(written, output)
            # Flushes the TensorBoard events before they are uploaded; MLflow's upload goes on beside S3's.
            self.reporter.close(wait=False)
            extras = [p for folder in ("logs", "samples", "best", "profile") for p in (output / folder).rglob("*")]
            self.store.publish_files(written + sorted(p for p in extras if p.is_file()), "final weights and logs")
            self._record_run(self.position.step, finished=True)
        self.store.flush()  # raises if the final weights could not be uploaded
        if self.is_main:
            log.info(TrainerLog.FINAL_WEIGHTS, ", ".join(self._store_uri(p) for p in written))
            self._write_report()
            if self.accelerator.device.type == "cuda":
                log.info("peak GPU memory on rank 0: %.2f GiB allocated, %.2f GiB reserved",
                         torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
            operator_reads = TrainerEnv.from_env(os.environ).final_read_seconds  # set in the operator's pods only
            if operator_reads:
                # Both ways to the operator: the termination message outlives the pod, the read comes sooner.
                self.reporter.write_final_report()
            self.reporter.await_final_read(operator_reads)
        self.reporter.close()
        self.store.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return output

    def abort(self) -> None:
        """Preempted or failed: what is already saved should still reach the bucket, within the
        pod's grace period (terminationGracePeriodSeconds leaves room for this)."""
        try:
            if not self.store.flush(timeout=PREEMPTION_UPLOAD_SECONDS):
                log.error("uploads still pending after %d s; the newest checkpoints stay local only",
                          PREEMPTION_UPLOAD_SECONDS)
        except UploadFailed as err:
            log.error("%s", err)
        stopped = isinstance(sys.exc_info()[1], (Preempted, KeyboardInterrupt))
        self.reporter.close("KILLED" if stopped else "FAILED", timeout=ABORT_SECONDS)
        self.store.close(wait=False)  # an upload still retrying must not hold the exit

    # --- set-up parts ---------------------------------------------------------------------------

    def _batching(self) -> Batching:
        """The spec's batching on a fresh start; on a resume, the checkpoint's global batch kept
        (on any number of processes) unless this run's spec asks for another batch."""
        training = self.spec.training
        fresh = Batching.fresh(training.batch_size, self.world_size, training.gradient_accumulation_steps)
        saved = self.saved
        if saved is None or (saved.batch_size, saved.accumulation) != (training.batch_size,
                                                                        training.gradient_accumulation_steps):
            return fresh
        return Batching.keeping(saved.global_batch, self.world_size, training.batch_size)

    def _prepare_model(self) -> None:
        """Strategy, sharding or replication, optimizer, schedule, EMA, the checkpoint state."""
        spec = self.spec
        on_gpu = self.accelerator.device.type == "cuda"
        strategy = resolve_strategy(spec, self.world_size, on_gpu, self._fits_under_ddp)
        if unsharded_note(spec, self.world_size):
            log.info(unsharded_note(spec, self.world_size))
        self.parallel = build_parallel(strategy, spec, self.accelerator)
        if use_channels_last(self.family.trainable_module, self.accelerator.device):
            log.info("%s in channels_last memory order", type(self.family.trainable_module).__name__)
        if spec.training.gradient_checkpointing:
            self.family.enable_gradient_checkpointing()
        self.model, self.optimizer = self.parallel.prepare(
            self.family.trainable_module, lambda params: build_optimizer(params, spec.training))
        self.scheduler = build_lr_scheduler(self.optimizer, spec.training, self.plan.total_steps)
        self.compiled = None
        if spec.training.compile:  # in place: names, state dicts and the wrappers stay the eager model's
            groups = getattr(self.dataset, "groups", None)
            self.compiled = compile_regions(self.parallel.unwrap(self.model), spec.training.compile_mode,
                                            shapes=len(set(groups)) if groups is not None else 1)
        set_optimizer_mode(self.optimizer, training=True)
        self.ema = None
        if spec.training.ema_decay:
            self.ema = EMA(self._trained_named(), spec.training.ema_decay)
            self.ema.attach(self.optimizer)
        self.sharded = ShardedState(self.model, self.optimizer, self.ema)

    def _fits_under_ddp(self) -> bool:
        from kubetune_trainer.planning import fits_under_ddp  # the memory estimate of `kubetune plan`

        return fits_under_ddp(self.spec, self.world_size, torch.cuda.get_device_properties(0).total_memory)

    def _base_model_version(self) -> str | None:
        """This run's version of spec.model.pretrained (storage.inputs.version_of), which every
        process must share: nodes that fetched it while it was being re-uploaded would otherwise
        train one adapter against different base weights, and nothing would show it."""
        versions = set(self._gather_objects(version_of(self.spec.model.pretrained)))
        if len(versions) > 1:
            raise InputsInFlux(f"spec.model.pretrained: the nodes of this run hold different versions of "
                               f"{origin(self.spec.model.pretrained)} (its files changed while the pods fetched "
                               "them: was it being uploaded?); stopping retryably, so that the restarted pods "
                               "fetch it again (a local path must hold the same files on every node)")
        return versions.pop()

    def _explain_resume(self, saved: SavedState) -> None:
        """Say how a resume on another number of processes (or with another batch, or another
        version of the base model) continues."""
        if saved.base_model is not None and saved.base_model != self.base_model:
            self.reporter.message("spec.model.pretrained %s has changed since the checkpoint was written (its "
                                  "files are not those the run trained on so far): training goes on from the "
                                  "checkpoint on the new files", origin(self.spec.model.pretrained))
        if saved.world_size != self.world_size:
            self.reporter.message("the checkpoint was written by %d process(es), this run has %d: %s; dropout's "
                                  "random state cannot follow the processes and differs from an uninterrupted run",
                                  saved.world_size, self.world_size, self.batching.describe())
        if saved.global_batch != self.batching.global_batch:
            self.reporter.message("global batch changed from %d to %d: continuing epoch %d after %d samples "
                                  "(step %d of the epoch)", saved.global_batch, self.batching.global_batch,
                                  self.position.epoch, saved.position.steps_in_epoch * saved.global_batch,
                                  self.position.steps_in_epoch)

    # --- during training ------------------------------------------------------------------------

    def _images_of(self, step: list[list]) -> list[Path]:
        """The image files of one step's micro-batches (keys (epoch, index) into the data set)."""
        return [path for keys in step for path in images_of(self.dataset, keys)]

    def _stop_streaming(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            stream = streamed(Path(self.spec.data.uri))
            # Images inside parquet files and shards are fetched as members (storage.members).
            # Ranged reads of parquet files and shards: their indexes and row groups, what a member costs.
            log.info("data stream: %d images fetched (%.1f MB; %d kept along with their row group's read), "
                     "%.1f MB read out of parquet files and shards, at most %.1f MB of planned images on disk",
                     stream.fetched_images + MEMBERS.fetched_images,
                     (stream.fetched_bytes + MEMBERS.fetched_bytes) / 1e6, self.prefetcher.kept_images,
                     MEMBERS.ranged_bytes / 1e6, self.prefetcher.peak / 1e6)

    def _epoch_steps(self) -> list:
        groups = getattr(self.dataset, "groups", None)
        epoch = 0 if self.spec.training.debug_overfit_batch else self.position.epoch
        steps = epoch_steps(len(self.dataset), self.batching.global_batch, self.spec.training.seed, epoch, groups)
        if self.spec.training.debug_overfit_batch:  # epoch 0's first step, augmentations included, every time
            steps = [steps[0]] * len(steps)
        return steps

    def _after_step(self) -> None:
        """Account for the steps whose numbers are in; stop if asked, validate when due, checkpoint
        when due. Where the run needs this step's loss now, its numbers are read at once."""
        pos = self.position
        validating = self.validator.due(pos.step, self.plan.total_steps)
        self._account(self.readout.read(drain=validating or self._checkpoint_due() or self._reads_every_loss))
        if self._stop_seen:
            self._account(self.readout.read(drain=True))  # the checkpoint records this step's loss
            with self.reporter.timed("checkpoint"):
                self.save_checkpoint(force=True)
            raise Preempted(pos.step, self.stop.cause())
        if pos.step == runs.MIN_STEPS:
            self._record_run(pos.step)  # from now on the run is worth keeping
        stop = False
        if validating:
            with self._weights_to_publish(), self.reporter.timed("validation"):
                metrics = self.validator.run(self.parallel.unwrap(self.model), pos.step,
                                             lambda: full_trained_state(self.model))
            self.reporter.validation(pos.step, metrics)
            if metrics:
                self.last_validation = {"step": pos.step, "metrics": metrics}
            if self.is_main:
                self.store.mirror("best")
                self.store.mirror("samples")
            if isinstance(self.scheduler, PlateauScheduler) and "loss" in metrics:
                self.scheduler.observe(metrics["loss"])
            stop = self.validator.should_stop
        with self.reporter.timed("checkpoint"):
            self.save_checkpoint(force=stop)
        if stop:
            raise EarlyStop

    def _validate_base(self) -> None:
        """Validation at step 0, before the first step, when validation is on: the model the run starts
        from (the base, for a LoRA) sampled and scored as every later validation, so each run's grids
        and curves start there. Not a result of the run, so neither early stopping nor keepBest counts
        it; a resumed run did it already."""
        if self.spec.validation.every_steps is None or self.start_checkpoint is not None or self.position.step:
            return
        with self._weights_to_publish(), self.reporter.timed("validation"):
            metrics = self.validator.run(self.parallel.unwrap(self.model), 0, ranked=False)
        self.reporter.validation(0, metrics)
        if self.is_main:
            self.store.mirror("samples")

    def _epoch_done(self) -> None:
        """Say how the embedding cache served the epoch (rank 0's share of the lookups)."""
        cache = self.family.cache
        if cache is None:
            return
        hits, misses = cache.hits - self._cache_seen[0], cache.misses - self._cache_seen[1]
        self._cache_seen = (cache.hits, cache.misses)
        if hits + misses:
            self.reporter.message("epoch %d: embedding cache %d hits, %d misses (%.1f%% hits)", self.position.epoch,
                                  hits, misses, 100.0 * hits / (hits + misses))

    def _account(self, results: list[StepResult]) -> None:
        """What the host learns of finished steps, in step order: every process reads the same
        steps at the same point, so all of them stop together on a non-finite loss or a stop request."""
        for done in results:
            if not math.isfinite(done.loss):
                raise TrainingDiverged(done.step, done.loss)
            self.position.loss = done.loss
            self.reporter.step(done.step, done.loss, done.lr, done.epoch, ended=done.ended)
            if done.step % self.spec.training.log_every_steps == 0:
                self.reporter.gpu_memory(done.memory)
            if self._reads_every_loss:
                self.scheduler.observe(done.loss)
            # Any process got SIGTERM: every process takes the last checkpoint together.
            self._stop_seen = self._stop_seen or done.stop_requested

    @property
    def _reads_every_loss(self) -> bool:
        """A plateau schedule without held-out data decays on each training loss before the next
        step: such a run reads every step's loss at once."""
        return isinstance(self.scheduler, PlateauScheduler) and self.held_out is None

    def _checkpoint_due(self) -> bool:
        step = self.position.step
        return step % self.spec.checkpoints.every_steps == 0 or step == self.plan.total_steps

    # --- helpers --------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    def _agree(self, decide):
        """The main process decides (and may refuse); every process gets the same answer or error."""
        from accelerate.utils import broadcast_object_list

        decided: list = [None]
        if self.is_main:
            try:
                decided[0] = ("ok", decide())
            except ConfigError as err:
                decided[0] = ("refused", err)
        broadcast_object_list(decided)
        outcome, value = decided[0]
        if outcome == "refused":
            raise value
        return value

    def _gather_objects(self, value) -> list:
        """One value from every process, in rank order (a collective)."""
        from accelerate.utils import gather_object

        return gather_object([value]) if self.world_size > 1 else [value]

    def _gather_tensors(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.world_size == 1:
            return [tensor]
        gathered = self.accelerator.gather(tensor.to(self.accelerator.device)[None])
        return list(gathered.cpu())

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """[1, k] on every process -> [world, k] in rank order (a collective, queued on the GPU)."""
        return self.accelerator.gather(row) if self.world_size > 1 else row

    def _trained_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        module = self.parallel.unwrap(self.model)
        return [(name, p) for name, p in module.named_parameters() if p.requires_grad]

    def _trained_to_publish(self) -> dict[str, torch.Tensor]:
        """The weights a user gets, whole on the main process: the EMA average, the schedule-free
        evaluation point. A collective under FSDP."""
        with self._weights_to_publish():
            return full_trained_state(self.model)

    @contextmanager
    def _weights_to_publish(self):
        set_optimizer_mode(self.optimizer, training=False)
        if self.ema is not None:
            self.ema.swap()
        try:
            yield
        finally:
            if self.ema is not None:
                self.ema.swap()
            set_optimizer_mode(self.optimizer, training=True)

    def _write_report(self) -> None:
        """report.html beside the final weights, once everything else is uploaded (it lists the
        checkpoints as storage has them). A run that trained never fails for its report: a warning
        says so, and `kubetune report` writes one later."""
        from kubetune_trainer.results.run_report import write_report
        from kubetune_trainer.checkpoint.catalog import describe_run
        from kubetune_trainer.storage.tree import LocalTree

        started = time.perf_counter()
        try:
            run = describe_run(self.run_place.uri, self.run_place.version)
            path = write_report(run, self.output / layout.REPORT_FILE, local=self.output,
                                files=LocalTree(self.output).files())
            self.store.publish_files([path], layout.REPORT_FILE)
            self.store.flush()
            log.info("report: %s (%.1f s)", self._store_uri(path), time.perf_counter() - started)
        except Exception as err:  # noqa: BLE001 - whatever broke, the weights are already safe
            log.warning("could not write the run's report (%s: %s); the weights and logs are saved: "
                        "`kubetune report %s` writes it", type(err).__name__, err, self.run_place.uri)

    def _record_run(self, steps: int, finished: bool = False) -> None:
        """run.json: how far the run got (a run that stops before runs.MIN_STEPS is cleaned up)."""
        if self.is_main:
            self.store.write_text(layout.RUN_FILE, runs.run_record_text(self.run_id, steps, finished),
                                  required=finished)

    def _tracker(self):
        """The main process's MLflow tracker (spec.tracking.mlflow), else None."""
        if not self.is_main:
            return None
        return tracker_for(self.job, self.namespace, self.run_place.uri, self.run_place.version)

    def _published(self, step: int, upload_seconds: float | None, size: int) -> None:
        self.reporter.checkpoint_published(step, upload_seconds, size)

    def _pending(self, count: int) -> None:
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.uploads_pending(count)

    def _store_uri(self, path: Path) -> str:
        """Where a file under the local run directory ends up (its s3:// URI when mirrored)."""
        if self.store.remote is None:
            return str(path)
        return self.store.remote.child(str(path.relative_to(self.store.local))).uri
