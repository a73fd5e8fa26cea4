"""SD1.5 LoRA training on the tiny model: the adapter loads in diffusers, resume is exact."""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess

import pytest
import torch

from tests.trainer.conftest import (copy_of_run, run_dir, run_trainer, run_trainer_expecting_failure, run_trainer_on,
                                   trained_weights, trainer_command, trainer_env, write_manifest)
from tests.unit.test_checkpoints import newest_step

pytestmark = pytest.mark.slow


def unet_output(pipeline) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=generator)
    context = torch.randn(1, 77, pipeline.unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        return pipeline.unet(sample, torch.tensor([500]), context).sample


def test_tiny_model_loads_through_from_pretrained(tiny_sd15):
    from diffusers import StableDiffusionPipeline

    pipeline = StableDiffusionPipeline.from_pretrained(tiny_sd15)
    tokens = pipeline.tokenizer("a red square").input_ids
    assert tokens[0] == pipeline.tokenizer.bos_token_id and tokens[-1] == pipeline.tokenizer.eos_token_id
    assert len(tokens) > 5, "the tokenizer splits words into known symbols, not unknown tokens"
    assert pipeline.tokenizer.unk_token_id not in tokens[1:-1], "CLIP's unknown token is its end token"


def test_short_training_writes_a_lora_that_diffusers_loads_and_that_changes_the_unet(tiny_job, tiny_sd15, tmp_path):
    from diffusers import StableDiffusionPipeline

    manifest = tiny_job(maxSteps=3)
    run_trainer(manifest, tmp_path)
    out = run_dir(tmp_path / "out")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert list((out / "logs").glob("events.out.tfevents.*")), "TensorBoard events are written"

    pipeline = StableDiffusionPipeline.from_pretrained(tiny_sd15)
    before = unet_output(pipeline)
    pipeline.load_lora_weights(out)
    after = unet_output(pipeline)
    assert pipeline.get_active_adapters(), "the LoRA was attached"
    assert (after - before).abs().max() > 1e-4, "the trained LoRA changes the UNet's prediction"


def test_checkpoints_are_kept_to_the_last_k(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=6)
    manifest["spec"]["checkpoints"].update(everySteps=2, keepLast=2)
    run_trainer(manifest, tmp_path)
    kept = sorted(p.name for p in run_dir(tmp_path / "out").glob("checkpoint-*"))
    assert kept == ["checkpoint-4", "checkpoint-6"]
    state = json.loads((run_dir(tmp_path / "out") / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["position"]["step"] == 6


def test_a_pod_killed_at_a_random_step_resumes_its_run_to_the_same_weights(tiny_job, tmp_path):
    """SIGKILL at a random step, restart the same run (same run id, as a restarted pod), compare
    with a run never interrupted: same step count, bitwise the same weights and state."""
    steps = 12
    kill_after = random.randint(4, 10)
    reference_dir, interrupted_dir = tmp_path / "reference", tmp_path / "interrupted"
    reference_dir.mkdir(), interrupted_dir.mkdir()

    reference = tiny_job(maxSteps=steps, gradientAccumulationSteps=2, lrScheduler="cosine", lrWarmupSteps=2)
    reference["spec"]["checkpoints"].update(uri=str(reference_dir / "out"), everySteps=3)
    reference["spec"]["data"]["randomFlip"] = True
    reference["spec"]["adapter"]["dropout"] = 0.1  # uses the global torch RNG, which must be restored too
    run_trainer(reference, reference_dir)

    interrupted = json.loads(json.dumps(reference))
    interrupted["spec"]["checkpoints"]["uri"] = str(interrupted_dir / "out")
    config = write_manifest(interrupted, interrupted_dir)
    pod_env = {**trainer_env(), "KUBETUNE_RUN_ID": "uid-of-the-trainingjob"}
    process = subprocess.Popen(trainer_command(config), env=pod_env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if f"step {kill_after}/" in line:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run was killed before it finished (step {kill_after})"
    out = run_dir(interrupted_dir / "out")
    assert not (out / "pytorch_lora_weights.safetensors").exists()

    resumed = run_trainer_on(config, env=pod_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", resumed.stderr).group(1))
    assert resumed_at % 3 == 0 and kill_after - 3 <= resumed_at <= kill_after, (kill_after, resumed_at)
    assert not run_dir(interrupted_dir / "out", version=1).exists(), "a restarted pod continues its own version"

    final = {name: trained_weights(run_dir(d / "out") / "checkpoint-12")
             for name, d in (("reference", reference_dir), ("interrupted", interrupted_dir))}
    assert final["reference"].keys() == final["interrupted"].keys()
    for key, tensor in final["reference"].items():
        assert torch.equal(tensor, final["interrupted"][key]), key
    states = [json.loads((run_dir(d / "out") / "checkpoint-12" / "trainer_state.json").read_text())
              for d in (reference_dir, interrupted_dir)]
    assert states[0] == states[1]
    assert states[0]["position"]["step"] == steps
    assert json.loads((out / "run.json").read_text())["finished"] is True


def test_runs_get_new_versions_and_one_that_died_before_five_steps_is_cleaned_up(sd15_run, tmp_path):
    manifest, _ = copy_of_run(sd15_run, tmp_path)  # a finished 2-step run as v0
    run_trainer(manifest, tmp_path)
    first, second = run_dir(tmp_path / "out", 0), run_dir(tmp_path / "out", 1)
    assert (first / "pytorch_lora_weights.safetensors").is_file(), "a finished run is never overwritten"
    assert (second / "pytorch_lora_weights.safetensors").is_file()

    crashed = run_dir(tmp_path / "out", 2)  # what a run that died at step 3 leaves behind
    (crashed / "checkpoint-2").mkdir(parents=True)
    (crashed / "run.json").write_text(json.dumps({"runId": None, "steps": 3, "finished": False}))
    result = run_trainer(manifest, tmp_path)
    assert not crashed.exists(), "the run that stopped before 5 steps is gone"
    assert "its run stopped before 5 steps" in result.stderr
    assert (run_dir(tmp_path / "out", 3) / "pytorch_lora_weights.safetensors").is_file(), "numbers are not reused"
    assert first.exists() and second.exists()


def test_resume_from_an_explicit_checkpoint_uri_and_refuse_an_incomplete_one(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=4)
    run_trainer(manifest, tmp_path)
    checkpoint = run_dir(tmp_path / "out") / "checkpoint-2"
    manifest["spec"]["training"]["maxSteps"] = 6
    manifest["spec"]["checkpoints"]["resumeFrom"] = str(checkpoint)
    result = run_trainer(manifest, tmp_path)
    assert f"resumed from {checkpoint} at step 2" in result.stderr
    state = json.loads((run_dir(tmp_path / "out", 1) / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["position"]["step"] == 6

    (checkpoint / "manifest.json").unlink()
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert f"spec.checkpoints.resumeFrom: {checkpoint} cannot be resumed: no manifest" in stderr


def test_a_resume_onto_other_base_weights_says_so_and_one_onto_the_same_does_not(tiny_sd15, tiny_job, tmp_path):
    """Two processes, as a pod runs them: the version is gathered from both and kept by rank 0."""
    from safetensors.torch import load_file, save_file

    from tests.trainer.test_distributed import train

    model = shutil.copytree(tiny_sd15, tmp_path / "model")
    manifest = tiny_job(maxSteps=2)
    manifest["spec"]["model"]["pretrained"] = str(model)
    train(manifest, tmp_path, nproc=2)
    checkpoint = run_dir(tmp_path / "out") / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["base_model"], "the version trained on"
    manifest["spec"]["training"]["maxSteps"] = 3
    manifest["spec"]["checkpoints"]["resumeFrom"] = str(checkpoint)
    notice = f"spec.model.pretrained {model} has changed since the checkpoint was written"
    assert notice not in train(manifest, tmp_path, nproc=2)

    vae = model / "vae" / "diffusion_pytorch_model.safetensors"  # re-uploaded: same shapes, other weights
    save_file({name: weight + 0.01 for name, weight in load_file(vae).items()}, vae, metadata={"format": "pt"})
    assert notice in train(manifest, tmp_path, nproc=2)


def test_two_processes_train_together_over_gloo(tiny_job, tmp_path):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    manifest = tiny_job(maxSteps=2)
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    checkpoint = run_dir(tmp_path / "out") / "checkpoint-2"
    assert (checkpoint / "rng-rank0.pt").is_file() and (checkpoint / "rng-rank1.pt").is_file()
    assert (run_dir(tmp_path / "out") / "pytorch_lora_weights.safetensors").is_file()


def test_resuming_with_a_different_rank_is_refused(sd15_run, tmp_path):
    manifest, _ = copy_of_run(sd15_run, tmp_path)  # a finished 2-step run of rank 4, ours to resume
    manifest["spec"]["training"]["maxSteps"] = 4
    manifest["spec"]["checkpoints"]["resumeFrom"] = "latest"
    manifest["spec"]["adapter"]["rank"] = 8
    config = write_manifest(manifest, tmp_path)
    result = run_trainer_on(config)
    assert result.returncode == 2
    assert "checkpoint-2 does not match the model being trained (spec.adapter type, rank" in result.stderr
    assert "of another shape" in result.stderr
    assert not run_dir(tmp_path / "out", version=1).exists(), "a refused resume writes nothing"


def test_fp16_on_a_cpu_job_is_refused_naming_the_option(tiny_job, tmp_path):
    manifest = tiny_job(mixedPrecision="fp16")
    config = write_manifest(manifest, tmp_path)
    result = run_trainer_on(config)
    assert result.returncode == 2
    assert ("spec.training.mixedPrecision fp16 needs a CUDA GPU: this job has spec.resources.gpusPerNode 0"
            in result.stderr), result.stderr


def test_bf16_mixed_precision_trains_on_cpu_and_writes_its_lora_in_bf16_unless_told(tiny_job, tmp_path):
    from safetensors.torch import load_file

    run_trainer(tiny_job(maxSteps=1, mixedPrecision="bf16"), tmp_path)
    weights = trained_weights(run_dir(tmp_path / "out") / "checkpoint-1")
    assert weights and all(t.dtype == torch.float32 for t in weights.values()), "trained weights stay in fp32"
    lora = load_file(run_dir(tmp_path / "out") / "pytorch_lora_weights.safetensors")
    assert {t.dtype for t in lora.values()} == {torch.bfloat16}, "the file in the training precision (saveDtype unset)"

    manifest = tiny_job(maxSteps=1, mixedPrecision="bf16")
    manifest["spec"]["adapter"]["saveDtype"] = "fp32"
    manifest["spec"]["checkpoints"]["uri"] = str(tmp_path / "fp32")
    run_trainer(manifest, tmp_path)
    lora32 = load_file(run_dir(tmp_path / "fp32") / "pytorch_lora_weights.safetensors")
    assert lora32.keys() == lora.keys() and {t.dtype for t in lora32.values()} == {torch.float32}


def test_sigterm_takes_a_last_checkpoint_and_exits_retryably(tiny_job, tmp_path):
    """Preemption: SIGTERM mid-run → a checkpoint at the current step, exit 143; a restart resumes there."""
    manifest = tiny_job(maxSteps=10_000, logEverySteps=1)
    manifest["spec"]["checkpoints"].update(everySteps=1_000_000, resumeFrom="latest")
    config = write_manifest(manifest, tmp_path)
    process = subprocess.Popen(trainer_command(config), env=trainer_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "step 6/" in line:  # past runs.MIN_STEPS: a stopped run younger than that is cleaned up
            break
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 143, "".join(seen[-5:]) + rest[-2000:]
    assert "stopped by SIGTERM after step" in rest

    saved = newest_step(run_dir(tmp_path / "out"))
    assert saved is not None and saved >= 6, "the last checkpoint was taken on SIGTERM"
    manifest["spec"]["training"]["maxSteps"] = saved + 1
    resumed = run_trainer(manifest, tmp_path)  # a new local run: resumeFrom latest takes the stopped one's
    assert f"at step {saved}" in resumed.stderr
    assert newest_step(run_dir(tmp_path / "out", version=1)) == saved + 1
