"""The GPU benchmark command works end to end (on the tiny model, on the CPU) and refuses clearly
without a GPU, so a GPU owner's single command is known to run."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
COMMAND = [sys.executable, "benchmarks/gpu_lora_step.py", "--family", "sdxl"]


def test_the_command_trains_from_a_filled_cache_and_prints_its_figures(tmp_path):
    result = subprocess.run([*COMMAND, "--tiny", "--device", "cpu", "--steps", "2", "--warmup-steps", "2", "--cache",
                             "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sdxl LoRA r16, tiny, 32 px, batch 1, bf16" in result.stdout
    assert "embedding cache filled first, compile off" in result.stdout
    # No weight file: every model was built from its configs, as the real architectures are on a GPU.
    built = [line.split("): ")[1].split(",")[0] for line in result.stdout.splitlines()
             if "random weights (a benchmark stand-in for " in line]
    assert sorted(built) == ["AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection",
                             "UNet2DConditionModel"], result.stdout
    assert not list((tmp_path / "sdxl-tiny-configs").rglob("*.safetensors")), "configs only: no weights written"
    assert float(result.stdout.split("seconds per step")[1].split()[0]) > 0
    assert "kubetune plan estimate" in result.stdout


def test_without_a_gpu_it_says_so_and_how_to_check_the_command():
    result = subprocess.run(COMMAND, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "needs a CUDA GPU (this process sees none); --tiny --device cpu checks the command itself" in result.stderr


def test_pmgs_command_gives_its_adapter_no_lora_rank(tmp_path):
    """PMG refuses spec.adapter.rank (families table): the benchmark's job must not carry one."""
    result = subprocess.run([sys.executable, "benchmarks/gpu_lora_step.py", "--family", "pmg", "--tiny", "--device",
                             "cpu", "--steps", "2", "--warmup-steps", "2", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pmg adapter (soft prompts, prefix, mapping), tiny, 32 px" in result.stdout


@pytest.mark.parametrize("script", ["benchmarks/clip_scorer.py", "benchmarks/metrics_overhead.py"])
def test_the_other_gpu_benchmarks_refuse_cuda_without_a_gpu(script):
    result = subprocess.run([sys.executable, script, "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "--device cuda: no CUDA device here; run it on a GPU machine (benchmarks/gpu_suite.sh)" in result.stderr


def test_frames_trains_a_video_family_on_clips_and_is_refused_for_an_image_family(tmp_path):
    refused = subprocess.run([*COMMAND, "--frames", "81"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--frames: family sdxl trains on no video layout" in refused.stderr
    result = subprocess.run([sys.executable, "benchmarks/gpu_lora_step.py", "--family", "wan", "--tiny", "--device",
                             "cpu", "--frames", "5", "--resolution", "48,32", "--steps", "1", "--warmup-steps", "2",
                             "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wan LoRA r16, tiny, [48, 32] px, 5 frames, batch 1" in result.stdout
    assert list((tmp_path / "video-captions-48-5f").glob("*.mp4")), "generated clips"
