#!/usr/bin/env bash
# Every GPU benchmark in one command, each under its own time cap, so that a short GPU lease
# yields what it can: the cases first that the open speed targets need (issue 28), then the rest.
#
#   PYTHON=python3 bash benchmarks/gpu_suite.sh OUT_DIR [NAME ...]
#
# NAME, in order: speed-sd15-cached, speed-sd15-compiled, throughput-full-size, speed-sdxl-cached,
# speed-sdxl-compiled (about 10 minutes on an H200: the speed targets); quantization, lora-sd15,
# lora-sdxl, lora-flux-kontext, lora-flux-kontext-gc, memory-flux-kontext-gc, memory-flux-kontext (the
# first figures and the memory targets, about 14 minutes);
# metrics-overhead, clip-scorer, lora-classifier, lora-pmg (about 8 minutes);
# lora-z-image, lora-flux2-klein, lora-sd35, lora-qwen-image, lora-qwen-image-edit,
# lora-qwen-image-edit-plus, lora-flux2 (the families of issue 25 and the Qwen-Image-Edit row still
# empty, about 20 minutes); lora-wan-81f (issue 26: one Wan 14B expert on 81-frame 832x480 clips);
# generate-sd15, generate-sdxl (issue 27: seconds per image at the real architectures).
# Default: all.
# Every model is built from its configs with random weights on the GPU (kubetune_trainer.models.random_weights):
# nothing but configs is written, so the 20-32B families fit the lent machines' 64 GiB disks.
# Writes OUT_DIR/device.txt (nvidia-smi -L, library versions) and one log per benchmark; prints
# each benchmark's exit status. A benchmark cut by its cap prints "rc=124". The figures go into
# benchmarks/RESULTS.md by hand, with the device line.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [NAME ...]}
shift
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
    nvidia-smi -L
    "$python" -c 'import torch, transformers, diffusers, peft, bitsandbytes, torchao
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "diffusers", diffusers.__version__, "peft", peft.__version__, "bitsandbytes", bitsandbytes.__version__,
      "torchao", torchao.__version__)'
} 2>&1 | tee "$out/device.txt"

wanted=("$@")

# name, cap in seconds, command: in order of what a lease must not miss.
run() {
    local name=$1 cap=$2
    shift 2
    if (( ${#wanted[@]} )) && [[ ! " ${wanted[*]} " =~ " $name " ]]; then
        return
    fi
    local started=$SECONDS
    timeout "$cap" "$python" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - started)) s"
    tail -n 12 "$out/$name.log"
}

# The speed targets (issue 28): SD1.5 and SDXL at batch 1 from a filled embedding cache, eager and
# compiled, and full-size SD1.5 at batch 8 against the diffusers-example loop. One model folder per
# family for its runs.
sd15_dir=$(mktemp -d)
run speed-sd15-cached 90 benchmarks/gpu_lora_step.py --family sd15 --cache --workdir "$sd15_dir"
run speed-sd15-compiled 170 benchmarks/gpu_lora_step.py --family sd15 --cache --compile default --workdir "$sd15_dir"
rm -rf "$sd15_dir"
run throughput-full-size 200 benchmarks/trainer_throughput.py --full-size --variants plain,cached
sdxl_dir=$(mktemp -d)
run speed-sdxl-cached 120 benchmarks/gpu_lora_step.py --family sdxl --cache --workdir "$sdxl_dir"
run speed-sdxl-compiled 200 benchmarks/gpu_lora_step.py --family sdxl --cache --compile default --workdir "$sdxl_dir"
rm -rf "$sdxl_dir"

run quantization 330 benchmarks/gpu_quantization_check.py --steps 6 --json "$out/quantization.json"
run lora-sd15 90 benchmarks/gpu_lora_step.py --family sd15
run lora-sdxl 130 benchmarks/gpu_lora_step.py --family sdxl
# One work directory for the FLUX.1 Kontext runs: its configs, data and embedding cache.
flux_dir=$(mktemp -d)
run lora-flux-kontext-gc 150 benchmarks/gpu_lora_step.py --family flux-kontext --gradient-checkpointing \
    --workdir "$flux_dir"
run lora-flux-kontext 90 benchmarks/gpu_lora_step.py --family flux-kontext --workdir "$flux_dir"
# The memory targets: a filled cache, so T5-XXL, CLIP and the VAE stay in CPU memory (encoderDevice auto).
run memory-flux-kontext-gc 120 benchmarks/gpu_lora_step.py --family flux-kontext --cache --gradient-checkpointing \
    --workdir "$flux_dir"
run memory-flux-kontext 100 benchmarks/gpu_lora_step.py --family flux-kontext --cache --workdir "$flux_dir"
rm -rf "$flux_dir"

# Figures first measured on 2026-11-26's second lease.
run metrics-overhead 150 benchmarks/metrics_overhead.py --device cuda
run clip-scorer 90 benchmarks/clip_scorer.py --device cuda
run lora-classifier 90 benchmarks/gpu_lora_step.py --family classifier
run lora-pmg 240 benchmarks/gpu_lora_step.py --family pmg

# The families of issue 25 (and Qwen-Image-Edit's row, empty until the models could be built on the
# GPU): LoRA r16 at 1024 px, batch 1, no cache, each its own cap (building the models takes seconds
# on the GPU; moving them through CPU memory as from_pretrained's would, ~10 s per 50 GB).
run lora-z-image 180 benchmarks/gpu_lora_step.py --family z-image
run lora-flux2-klein 180 benchmarks/gpu_lora_step.py --family flux2-klein
run lora-sd35 200 benchmarks/gpu_lora_step.py --family sd35
run lora-qwen-image 240 benchmarks/gpu_lora_step.py --family qwen-image
run lora-qwen-image-edit 240 benchmarks/gpu_lora_step.py --family qwen-image-edit
run lora-qwen-image-edit-plus 240 benchmarks/gpu_lora_step.py --family qwen-image-edit-plus
# FLUX.2 [dev]: 32B in bf16 plus Mistral 24B does not fit with activations; fp8 from the cache (planned).
run lora-flux2 300 benchmarks/gpu_lora_step.py --family flux2 --cache --quantization fp8

# Wan (issue 26): one 14B expert (Wan2.1-T2V-14B's architecture, = each Wan 2.2 A14B expert) on generated
# 81-frame 832x480 H.264 clips, with checkpointing; the published figure to compare: ~10 s/step on an H200.
run lora-wan-81f 360 benchmarks/gpu_lora_step.py --family wan --frames 81 --resolution 832,480 --gradient-checkpointing

# Generation (issue 27): seconds per image through kubetune_trainer.results.generation (validation's sampler),
# the real architectures with random weights built on the GPU, at their native sizes, 20 steps.
run generate-sd15 180 benchmarks/generate.py --full-size --device cuda --family sd15 --steps 20 --images 2 --repeats 2
run generate-sdxl 240 benchmarks/generate.py --full-size --device cuda --family sdxl --steps 20 --images 2 --repeats 2
