#!/usr/bin/env bash
# `make demo`: the SD1.5 LoRA example end to end on this machine, with no downloads; it ends with
# something to look at: the base-vs-fine-tuned grid and the run's report.
# A tiny random-weight SD1.5 in the diffusers layout and a small generated captions data set
# stand in for the real ones; the manifest is the example a cluster user applies, unchanged
# except for the --set overrides below (fp32: bf16 is emulated, slowly, on most CPUs).
set -euo pipefail
out=${1:-out/demo}
kubetune=.venv/bin/kubetune
rm -rf "$out/checkpoints"
mkdir -p "$out"
[ -f "$out/model/model_index.json" ] || $kubetune dev tiny-model --family sd15 --out "$out/model"
[ -f "$out/data/metadata.jsonl" ] || $kubetune dev tiny-data --layout captions --out "$out/data" --count 16 --size 64
$kubetune validate -f manifests/examples/sd15-lora.yaml
$kubetune train -f manifests/examples/sd15-lora.yaml \
  --set spec.model.pretrained="$out/model" \
  --set spec.data.uri="$out/data" \
  --set spec.data.resolution=32 \
  --set spec.training.maxSteps=20 \
  --set spec.training.lrWarmupSteps=2 \
  --set spec.training.learningRate=1.0e-3 \
  --set spec.checkpoints.uri="$out/checkpoints" \
  --set spec.checkpoints.everySteps=10 \
  --set 'spec.training.mixedPrecision="no"' \
  --set spec.resources.gpusPerNode=0 \
  --set spec.validation.everySteps=10 \
  --set 'spec.validation.prompts=["a yellow circle", "a green square"]'
# Each run gets <checkpoints.uri>/<namespace>/<name>/v<N>; the checkpoints were cleared above, so v0.
run="$out/checkpoints/default/sd15-lora-demo/v0"
# Something to look at: the base model and the fine-tuned one on the validation prompts, side by side.
$kubetune generate "$run" --compare --out "$out/compare" --force
echo
echo "Base vs fine-tuned: $out/compare/grid.png (top row: base; bottom: the LoRA)"
echo "Report:             $run/report.html (curves, validation grids from step 0, the spec, the weights)"
echo "LoRA:               $run/pytorch_lora_weights.safetensors"
echo "Load it: StableDiffusionPipeline.from_pretrained('$out/model').load_lora_weights('$run')"
echo "Checkpoints: $kubetune checkpoints ls $out/checkpoints/default/sd15-lora-demo"
echo "TensorBoard: .venv/bin/tensorboard --logdir $run/logs"
