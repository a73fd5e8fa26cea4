"""Several processes train as one: the same weights as one process, sharded or not; SIGTERM to a
node's launcher checkpoints every rank and exits 143; a run resumes at another number of processes
with every sample of every epoch trained once."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubetune_api.ports import free_listen_port
from kubetune_trainer.process.preemption import RETRYABLE_EXIT_CODE
from tests import warm_python
from tests.trainer.conftest import family_job, run_dir, trained_weights, trainer_env, write_manifest

pytestmark = pytest.mark.slow

FAMILIES = [("sd15", "captions"), ("sdxl", "captions"), ("flux-kontext", "edit-pairs"),
            ("qwen-image-edit", "edit-pairs"), ("pmg", "pmg"), ("classifier", "image-folder"),
            ("wan", "video-captions")]  # clips: a random start per sample and epoch, both experts routed
# What each layout's job sets besides the batch split: random draws where the layout has them.
DRAWS = {"pmg": {}, "video-captions": {"randomFlip": True, "centerCrop": False, "frames": 5}}
# fp32 on the CPU: the same samples and draws, summed in another order (per process, then
# all-reduced, through kernels chosen by batch shape) differ in the last bits. Plain SGD keeps
# such differences as small as they start (Adam would blow a near-zero gradient's noise up to a
# full learning-rate step), so the runs must agree to a thousandth of what training changed.
RELATIVE_TOLERANCE = 1e-3
TOLERANCE = 2e-4  # for runs that differ only in how the same steps were split over time (resumes)


def kubetune_command(manifest: dict, directory: Path, nproc: int) -> list[str]:
    """`kubetune train -f JOB --nproc N`, as a user runs it."""
    return [sys.executable, "-m", "kubetune_cli.main", "train", "-f", str(write_manifest(manifest, directory)),
            "--nproc", str(nproc)]


def kubetune_train(manifest: dict, directory: Path, nproc: int, extra_env: dict | None = None,
                   **popen) -> subprocess.Popen:
    """kubetune_command in a fresh process, for the tests that signal it or watch its log as it runs."""
    return subprocess.Popen(kubetune_command(manifest, directory, nproc), env={**trainer_env(), **(extra_env or {})},
                            text=True, **popen)


def train(manifest: dict, directory: Path, nproc: int, extra_env: dict | None = None) -> str:
    """kubetune_command run to its end: its stderr. `kubetune train` itself is forked from the worker's
    pre-imported interpreter (tests/warm_python.py); with --nproc N it is the launcher, whose N trainer
    processes start as on a user's machine."""
    result = warm_python.run(kubetune_command(manifest, directory, nproc), env={**trainer_env(), **(extra_env or {})},
                             timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def stop_after(process: subprocess.Popen, marker: str, target_pid: int | None = None) -> str:
    """Read the run's log until `marker`, then SIGTERM the launcher (or target_pid); the rest of the log."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if marker in line:
            os.kill(target_pid or process.pid, signal.SIGTERM)
            break
    _, rest = process.communicate(timeout=300)
    return "".join(seen) + rest


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("family,layout", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_two_processes_ddp_or_fsdp_and_accumulation_train_the_weights_one_process_trains(
        family, layout, tiny_model, tiny_dataset, tmp_path):
    """One global batch of 4 per step, split four ways: 1 x 4, 2 x 2 (DDP), 2 x 2 (FSDP), and for SD1.5 1 x 2 x 2
    accumulated (accumulation is the training loop's, the same for every family; a family's loss
    that is not a mean over its batch shows in DDP's split already)."""
    def job(name: str, batch: int, accumulation: int = 1, strategy: str = "ddp") -> dict:
        return family_job(family, layout, tiny_model(family), tiny_dataset(layout), tmp_path / name,
                          training={"maxSteps": 3, "batchSize": batch, "gradientAccumulationSteps": accumulation,
                                    "optimizer": "sgd", "sgdMomentum": 0.0, "learningRate": 0.1,
                                    "weightDecay": 0.0},
                          data=DRAWS.get(layout, {"randomFlip": True, "centerCrop": False}),
                          checkpoints={"everySteps": 1}, distributed={"strategy": strategy})

    runs = {"one": (job("one", 4), 1), "ddp": (job("ddp", 2), 2), "fsdp": (job("fsdp", 2, strategy="fsdp"), 2)}
    if family == FAMILIES[0][0]:
        runs["accumulated"] = (job("accumulated", 2, accumulation=2), 1)
    logs = {name: train(manifest, tmp_path, nproc) for name, (manifest, nproc) in runs.items()}
    assert "2 process(es) (fsdp)" in logs["fsdp"] and "2 process(es) (ddp)" in logs["ddp"]
    weights = {name: trained_weights(run_dir(tmp_path / name) / "checkpoint-3") for name in runs}
    trained = max_difference(weights["one"], trained_weights(run_dir(tmp_path / "one") / "checkpoint-1"))
    assert trained > 0, "training changed the weights"
    for name in runs.keys() - {"one"}:
        assert max_difference(weights["one"], weights[name]) < RELATIVE_TOLERANCE * trained, name
    published = {name: {f.name: load_file(f) for f in run_dir(tmp_path / name).glob("*.safetensors")}
                 for name in ("one", "fsdp")}
    assert published["one"] and published["one"].keys() == published["fsdp"].keys()
    for file, tensors in published["one"].items():
        assert max_difference(tensors, published["fsdp"][file]) < RELATIVE_TOLERANCE * trained, \
            f"{file}: the adapter gathered from two shards is the one-process adapter"


def test_sigterm_to_the_launcher_checkpoints_every_rank_exits_143_and_resumes_to_the_same_weights(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=14, logEverySteps=1)
    manifest["spec"]["checkpoints"].update(everySteps=5)
    reference = json.loads(json.dumps(manifest))
    reference["spec"]["checkpoints"]["uri"] = str(tmp_path / "reference")
    train(reference, tmp_path, nproc=2)

    pod = {"KUBETUNE_RUN_ID": "uid-1"}  # a restarted pod of the same TrainingJob
    process = kubetune_train(manifest, tmp_path, 2, pod, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = stop_after(process, "step 7/")
    assert process.returncode == 143, log[-3000:]
    assert log.count("stopped by SIGTERM after step") == 2, "both ranks stopped at the same step boundary"
    stopped_at = int(log.split("stopped by SIGTERM after step ")[1].split(";")[0])
    last = run_dir(tmp_path / "out") / f"checkpoint-{stopped_at}"
    manifest_files = json.loads((last / "manifest.json").read_text())["files"]
    assert {"state/__0_0.distcp", "state/__1_0.distcp", "rng-rank0.pt", "rng-rank1.pt"} <= set(manifest_files), \
        "one checkpoint with both ranks' shards"

    resumed = train(manifest, tmp_path, 2, pod)
    assert f"resumed from {last} at step {stopped_at}" in resumed
    final = trained_weights(run_dir(tmp_path / "out") / "checkpoint-14")
    expected = trained_weights(run_dir(tmp_path / "reference") / "checkpoint-14")
    assert all(torch.equal(final[k], expected[k]) for k in expected), "bitwise the uninterrupted run's weights"


def test_sigterm_while_models_load_ends_every_process_at_once_with_143(tiny_job, tmp_path):
    process = kubetune_train(tiny_job(maxSteps=1000), tmp_path, 2, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = stop_after(process, "loading sd15 from")
    assert process.returncode == 143, log[-3000:]
    assert "stopped by SIGTERM before training started" in log
    assert not list((tmp_path / "out").rglob("checkpoint-*")), "nothing to save yet"


def two_nodes_of_two_processes(manifest: dict, directory: Path, working_dirs: list[Path] | None = None,
                               **popen) -> list[subprocess.Popen]:
    """Two launchers (the container entry point two pods run) of one job, two processes each;
    working_dirs: each node's own (relative paths in the manifest then name each node's files)."""
    config = write_manifest(manifest, directory)
    port = free_listen_port()
    return [subprocess.Popen([sys.executable, "-m", "kubetune_trainer.pod", "--config", str(config)],
                             env={**trainer_env(), "PET_NNODES": "2", "PET_NODE_RANK": str(rank),
                                  "PET_NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "KUBETUNE_RUN_ID": "uid-2"},
                             cwd=working_dirs[rank] if working_dirs else None,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
            for rank in (0, 1)]


def test_nodes_that_hold_different_versions_of_the_base_model_are_refused_before_anything_is_written(
        tiny_sd15, captions_data, tmp_path):
    """Two pods that fetched spec.model.pretrained while it was being re-uploaded: the same path on
    both nodes, other weights of the same shapes (and size) on one."""
    from safetensors.torch import save_file

    nodes = [tmp_path / "node-0", tmp_path / "node-1"]
    for node in nodes:
        shutil.copytree(tiny_sd15, node / "model")  # copies keep their files' times: one version
    vae = nodes[1] / "model" / "vae" / "diffusion_pytorch_model.safetensors"
    save_file({name: weight + 0.01 for name, weight in load_file(vae).items()}, vae, metadata={"format": "pt"})
    manifest = family_job("sd15", "captions", "./model", captions_data, tmp_path / "out")
    launched = two_nodes_of_two_processes(manifest, tmp_path, working_dirs=nodes)
    logs = [node.communicate(timeout=300)[1] for node in launched]
    assert [node.returncode for node in launched] == [RETRYABLE_EXIT_CODE] * 2, logs
    for log in logs:
        assert ("spec.model.pretrained: the nodes of this run hold different versions of ./model "
                "(its files changed while the pods fetched them") in log, log[-3000:]
    assert not (tmp_path / "out").exists(), "refused before the run claimed a version or wrote a file"


def test_a_worker_node_stopped_alone_stops_the_other_node_too_both_retryably(tiny_job, tmp_path):
    """Two nodes x two processes (two launchers, as two pods get them); SIGTERM to node 1 only."""
    nodes = two_nodes_of_two_processes(tiny_job(maxSteps=1000, logEverySteps=1), tmp_path)
    log = stop_after(nodes[0], "step 6/", target_pid=nodes[1].pid)
    _, worker_log = nodes[1].communicate(timeout=300)
    assert [n.returncode for n in nodes] == [143, 143], log[-2000:] + worker_log[-2000:]
    assert log.count("stopped by another process's stop request (SIGTERM) after step") == 2, \
        "node 0's processes got no signal: they stopped because node 1 asked"
    assert worker_log.count("stopped by SIGTERM after step") == 2
    stopped_at = int(log.split("stop request (SIGTERM) after step ")[1].split(";")[0])
    last = run_dir(tmp_path / "out") / f"checkpoint-{stopped_at}"
    files = json.loads((last / "manifest.json").read_text())["files"]
    assert {f"state/__{rank}_0.distcp" for rank in range(4)} <= set(files), "every rank of both nodes saved"
    assert "training tiny: 1000 steps, 4 process(es)" in log


def test_sigterm_to_each_pods_whole_process_group_at_once_stops_all_ranks_together_with_143(tiny_job, tmp_path):
    """What a suspend (Kueue, spec.suspend) does to a 2-node job when the runtime signals process
    groups (tini/dumb-init -g, our process kubelet): every worker gets SIGTERM twice, from the group
    signal and from its launcher, microseconds apart; once that deadlocked a rank until SIGKILL."""
    nodes = two_nodes_of_two_processes(tiny_job(maxSteps=1000, logEverySteps=1), tmp_path, start_new_session=True)
    seen = []
    for line in nodes[0].stderr:
        seen.append(line)
        if "step 6/" in line:
            for node in nodes:
                os.killpg(node.pid, signal.SIGTERM)
            break
    logs = ["".join(seen) + nodes[0].communicate(timeout=300)[1], nodes[1].communicate(timeout=300)[1]]
    assert [n.returncode for n in nodes] == [143, 143], logs[0][-2000:] + logs[1][-2000:]
    # Each rank names its own signal, or (had it not run its handler by the step boundary) another's.
    stops = [int(step) for log in logs for step in re.findall(r"stopped by .+? after step (\d+);", log)]
    assert len(stops) == 4 and len(set(stops)) == 1, f"all four ranks stopped at one agreed step: {stops}"
    steps = set(stops)
    files = json.loads((run_dir(tmp_path / "out") / f"checkpoint-{steps.pop()}" / "manifest.json").read_text())["files"]
    assert {f"state/__{rank}_0.distcp" for rank in range(4)} <= set(files), "every rank of both nodes saved"


def test_a_diverging_run_stops_every_rank_of_both_nodes_at_one_step_exits_3_and_keeps_its_checkpoints(
        tiny_job, tmp_path):
    """A real fault mid-run: a full fine-tune at learning rate 1 with no clipping blows up in a few
    steps. Every rank sees the same all-reduced loss, so all stop at that step (none waits in a
    collective), and 3 tells the restart policy that a retry would diverge again."""
    manifest = tiny_job(maxSteps=40, logEverySteps=1, optimizer="sgd", learningRate=1.0, maxGradNorm=0.0)
    manifest["spec"]["adapter"] = {"type": "full"}
    manifest["spec"]["checkpoints"].update(everySteps=2)
    nodes = two_nodes_of_two_processes(manifest, tmp_path)
    logs = [node.communicate(timeout=300)[1] for node in nodes]
    assert [n.returncode for n in nodes] == [3, 3], logs[0][-2000:] + logs[1][-2000:]
    diverged = [int(step) for log in logs for step in re.findall(r"training diverged: step (\d+) gave a loss", log)]
    assert len(diverged) == 4 and len(set(diverged)) == 1, diverged
    step = diverged[0]
    assert 2 < step < 40, "it diverged mid-run, after a checkpoint"
    run = run_dir(tmp_path / "out")
    complete = sorted(int(p.parent.name.split("-")[1]) for p in run.glob("checkpoint-*/manifest.json"))
    assert complete and max(complete) < step and step - max(complete) <= 2, (complete, step)
    published = [p for p in run.rglob("*.safetensors") if not p.relative_to(run).parts[0].startswith("checkpoint-")]
    assert not published, "no final weights from a diverged run"


def test_a_run_resumes_on_3_then_2_then_1_processes_training_each_sample_of_each_epoch_once(
        tiny_sd15, tiny_dataset, tmp_path):
    from kubetune_trainer.data.tiny_data import write_tiny_data

    data = write_tiny_data("captions", tmp_path / "data12", count=12, size=32, seed=0)
    manifest = family_job("sd15", "captions", tiny_sd15, data, tmp_path / "out",
                          training={"maxSteps": 12, "batchSize": 2, "logEverySteps": 1},  # 6 samples per step
                          checkpoints={"everySteps": 100})
    sample_log = tmp_path / "samples.jsonl"
    pod = {"KUBETUNE_RUN_ID": "uid-3", "KUBETUNE_SAMPLE_LOG": str(sample_log)}
    # A step's line is logged after the next step is queued, and a SIGTERM stops every process at the
    # end of the step after the one it arrived in (the host reads each step one step late): a stop
    # lands up to three steps after the line that triggered it.
    for nproc, stop_at in ((3, "step 2/"), (2, "step 6/")):
        process = kubetune_train(manifest, tmp_path, nproc, pod, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        log = stop_after(process, stop_at)
        assert process.returncode == 143, log[-3000:]
    log = train(manifest, tmp_path, 1, pod)
    assert "the checkpoint was written by 2 process(es), this run has 1: global batch 6 = 1 process(es) x 3" in log

    trained = Counter()
    for line in sample_log.read_text().splitlines():
        record = json.loads(line)
        trained.update(tuple(key) for key in record["keys"])
    epochs = {epoch for epoch, _ in trained}
    assert epochs == {0, 1, 2, 3, 4, 5}, "12 steps of 6 samples: 6 epochs of 12"
    assert trained == Counter({(epoch, index): 1 for epoch in epochs for index in range(12)}), \
        "no sample of any epoch skipped or repeated across the three resumes"

    reference = json.loads(json.dumps(manifest))  # never interrupted: one process, the same 6 samples a step
    reference["spec"]["checkpoints"]["uri"] = str(tmp_path / "reference")
    reference["spec"]["training"]["gradientAccumulationSteps"] = 3
    train(reference, tmp_path, 1)
    assert max_difference(trained_weights(run_dir(tmp_path / "out") / "checkpoint-12"),
                          trained_weights(run_dir(tmp_path / "reference") / "checkpoint-12")) < TOLERANCE


def test_clips_resumed_mid_epoch_on_two_processes_continue_with_the_same_clips_and_start_frames(
        tiny_model, tiny_dataset, tmp_path):
    """Wan on 8 clips of 9 frames, 5 frames a sample (5 possible starts), 2 processes x 1 clip a step:
    4 steps an epoch. A run resumed from the uninterrupted run's checkpoint-3 (mid-epoch 0) trains
    steps 4 and 5 (the last of epoch 0, the first of epoch 1) on the same clips from the same start
    frames, to the same weights."""
    def job(name: str, **checkpoints) -> dict:
        return family_job("wan", "video-captions", tiny_model("wan"), tiny_dataset("video-captions"), tmp_path / name,
                          data={"frames": 5}, training={"maxSteps": 5, "batchSize": 1},
                          checkpoints={"everySteps": 3, **checkpoints})

    def trained_steps(log: Path) -> dict[int, list]:
        """step -> [(rank, key, start)] of every sample trained at it."""
        steps: dict[int, list] = {}
        for line in log.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(
                sorted((record["rank"], tuple(key), start) for key, start in zip(record["keys"], record["frame_starts"])))
        return {step: sorted(samples) for step, samples in steps.items()}

    train(job("whole"), tmp_path, 2, {"KUBETUNE_SAMPLE_LOG": str(tmp_path / "whole.jsonl")})
    checkpoint = run_dir(tmp_path / "whole") / "checkpoint-3"
    resumed_log = train(job("resumed", resumeFrom=str(checkpoint)), tmp_path, 2,
                        {"KUBETUNE_SAMPLE_LOG": str(tmp_path / "resumed.jsonl")})
    assert f"resumed from {checkpoint} at step 3" in resumed_log, resumed_log[-3000:]
    whole, resumed = trained_steps(tmp_path / "whole.jsonl"), trained_steps(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3, 4], "the resumed run trains the steps after checkpoint-3 only (0-based)"
    assert {step: whole[step] for step in resumed} == resumed
    assert {epoch for samples in resumed.values() for _, (epoch, _), _ in samples} == {0, 1}, "across an epoch"
    starts = {start for samples in whole.values() for *_, start in samples}
    assert len(starts) > 1, f"clips start at different frames: {starts}"
    assert max_difference(trained_weights(run_dir(tmp_path / "whole") / "checkpoint-5"),
                          trained_weights(run_dir(tmp_path / "resumed") / "checkpoint-5")) < TOLERANCE


def test_a_world_too_large_for_the_checkpoints_global_batch_is_refused_and_writes_nothing(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=2, batchSize=1)  # a global batch of 2 on two processes
    train(manifest, tmp_path, 2)
    manifest["spec"]["training"]["maxSteps"] = 4
    manifest["spec"]["checkpoints"]["resumeFrom"] = str(run_dir(tmp_path / "out") / "checkpoint-2")
    process = kubetune_train(manifest, tmp_path, 3, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, log = process.communicate(timeout=300)
    assert process.returncode == 2, log[-3000:]
    assert "this run's global batch is 2 samples per optimizer step, fewer than the 3 processes" in log
    assert not run_dir(tmp_path / "out", version=1).exists(), "refused before the run claimed a version"


def test_full_fine_tuning_sharded_over_two_processes_publishes_a_whole_loadable_unet(tiny_job, tiny_sd15, tmp_path):
    from diffusers import UNet2DConditionModel

    manifest = tiny_job(maxSteps=2, learningRate=1e-3)
    manifest["spec"]["adapter"] = {"type": "full"}
    manifest["spec"]["distributed"] = {"strategy": "fsdp"}
    train(manifest, tmp_path, 2)
    trained = UNet2DConditionModel.from_pretrained(run_dir(tmp_path / "out") / "unet")
    base = UNet2DConditionModel.from_pretrained(tiny_sd15, subfolder="unet")
    changed = [name for name, p in trained.named_parameters()
               if not torch.equal(p, dict(base.named_parameters())[name])]
    assert len(changed) > len(list(base.parameters())) // 2, "a full fine-tune, gathered from both shards"
    saved = trained_weights(run_dir(tmp_path / "out") / "checkpoint-2")
    assert all(torch.equal(saved[name], p) for name, p in trained.named_parameters()), \
        "the published UNet is the checkpoint's"


def test_fsdp_with_checkpointing_ema_and_best_k_resumes_on_one_process(tiny_job, tmp_path):
    """Every collective path under FSDP (activation checkpointing, the EMA's shards, validation's
    gather of the best weights), then the sharded EMA and optimizer resharded onto one process."""
    manifest = tiny_job(maxSteps=6, gradientCheckpointing=True, emaDecay=0.9)
    manifest["spec"]["distributed"] = {"strategy": "fsdp"}
    manifest["spec"]["validation"] = {"everySteps": 2, "heldOutFraction": 0.25, "keepBest": 1}
    manifest["spec"]["checkpoints"]["everySteps"] = 100
    pod = {"KUBETUNE_RUN_ID": "uid-4"}
    process = kubetune_train(manifest, tmp_path, 2, pod, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = stop_after(process, "step 3/")
    assert process.returncode == 143, log[-3000:]
    assert "2 process(es) (fsdp)" in log
    log = train(manifest, tmp_path, 1, pod)
    assert "the checkpoint was written by 2 process(es), this run has 1" in log
    out = run_dir(tmp_path / "out")
    assert any(key.startswith("ema.") for key in trained_weights_keys(out / "checkpoint-6"))
    assert list((out / "best").glob("step-*/pytorch_lora_weights.safetensors")), "the best weights, gathered"


def trained_weights_keys(checkpoint: Path) -> list[str]:
    from tests.trainer.conftest import saved_keys

    return saved_keys(checkpoint)


def test_a_gpu_job_on_a_node_without_a_gpu_fails_at_start_naming_the_field(tiny_job, tmp_path):
    manifest = tiny_job()
    manifest["spec"]["resources"]["gpusPerNode"] = 1
    manifest["spec"]["training"]["mixedPrecision"] = "bf16"
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer", "--config", str(write_manifest(manifest, tmp_path))],
                            env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "spec.resources.gpusPerNode is 1 but this process sees no GPU" in result.stderr
    assert "set spec.resources.gpusPerNode: 0 to train on the CPU" in result.stderr


def test_sigterm_during_the_cache_stage_ends_it_at_once_with_143(tiny_sd15, tmp_path):
    from kubetune_trainer.data.tiny_data import write_tiny_data

    data = write_tiny_data("captions", tmp_path / "many", count=400, size=32, seed=1)
    manifest = family_job("sd15", "captions", tiny_sd15, data, tmp_path / "out", data={"cache": {"enabled": True}})
    process = subprocess.Popen([sys.executable, "-m", "kubetune_trainer", "--config",
                                str(write_manifest(manifest, tmp_path)), "--cache-only"],
                               env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    log = stop_after(process, "loading sd15 from")
    assert process.returncode == 143, log[-2000:]
    assert "stopped by SIGTERM before training started" in log
    assert time.monotonic() - started < 60


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = set(), [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found.update(children)
        frontier += children
    return found


def test_ctrl_c_stops_kubetune_train_like_sigterm_and_leaves_no_process_behind(tiny_job, tmp_path):
    process = kubetune_train(tiny_job(maxSteps=1000, logEverySteps=1), tmp_path, 2,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "step 3/" in line:
            break
    workers = descendants(process.pid)
    assert len(workers) >= 2, "the launcher's trainer processes"
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=300)
    log = "".join(seen) + rest
    assert process.returncode == 143, log[-3000:]
    assert log.count("stopped by SIGINT after step") == 2
    assert list(run_dir(tmp_path / "out").glob("checkpoint-*/manifest.json")), "the last checkpoint, complete"
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "no trainer outlives kubetune train"


def test_a_sharded_resume_trains_with_the_learning_rate_its_spec_now_gives(tiny_job, tmp_path):
    """What population-based training does to a copied trial: resume its checkpoint with another
    learning rate, here under FSDP on two processes (the optimizer's state comes back sharded, its
    rate from the spec). Plain SGD steps by rate x gradient, and the resumed step sees the gradient
    the first run saw at that step (same weights, samples and noise), so twice the rate is twice the step."""
    manifest = tiny_job(maxSteps=5, optimizer="sgd", sgdMomentum=0.0, learningRate=0.05, maxGradNorm=0.0,
                        logEverySteps=1)
    manifest["spec"]["distributed"] = {"strategy": "fsdp"}
    manifest["spec"]["checkpoints"]["everySteps"] = 1
    train(manifest, tmp_path, 2)
    first = run_dir(tmp_path / "out")
    manifest["spec"]["training"]["learningRate"] = 0.1
    manifest["spec"]["checkpoints"]["resumeFrom"] = str(first / "checkpoint-4")
    log = train(manifest, tmp_path, 2)
    assert re.search(r"step 5/5 loss [\d.]+ lr 1\.000e-01", log), log[-3000:]
    resumed = run_dir(tmp_path / "out", version=1)
    start = trained_weights(first / "checkpoint-4")
    step_at_first_rate = {k: v - start[k] for k, v in trained_weights(first / "checkpoint-5").items()}
    step_at_twice_the_rate = {k: v - start[k] for k, v in trained_weights(resumed / "checkpoint-5").items()}
    size = max(v.abs().max().item() for v in step_at_twice_the_rate.values())
    assert size > 0
    assert max_difference({k: 2 * v for k, v in step_at_first_rate.items()}, step_at_twice_the_rate) \
        < RELATIVE_TOLERANCE * size
