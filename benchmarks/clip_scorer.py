"""What the CLIP metrics cost a validation: spec.validation.clipModel at CLIP ViT-L/14's size.

    .venv/bin/python benchmarks/clip_scorer.py                   # CPU
    python3 benchmarks/clip_scorer.py --device cuda              # GPU (benchmarks/gpu_suite.sh)

Writes a CLIPModel with ViT-L/14's architecture (random weights: the cost does not depend on the
values) with a tokenizer and CLIP's 224-px image processor, loads it through the trainer's
ClipScorer (as a run loads spec.validation.clipModel), and times clip_score and clip_directional
on --images random 512-px images, each call moving the model onto the device and back to CPU
memory (what ClipScorer does so training keeps its GPU memory). The first call of each is a
warm-up. Figures are printed (a benchmark: nothing is asserted).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# CLIP ViT-L/14's vision tower (304M) beside its text tower (reference_models.CLIP_L_TEXT).
CLIP_L_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     image_size=224, patch_size=14, hidden_act="quick_gelu")


def write_clip_l(out_dir: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from kubetune_trainer.families.components import CLIP_L_TEXT
    from kubetune_trainer.models.tiny_models import tiny_clip_tokenizer

    text = {k: v for k, v in CLIP_L_TEXT.items() if k != "projection_dim"}
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=CLIP_L_VISION, projection_dim=768))
    model.save_pretrained(out_dir, safe_serialization=True)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tiny_clip_tokenizer()).save_pretrained(out_dir)
    return out_dir


def timed(call, repeats: int) -> float:
    """Median seconds of `call` after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--images", type=int, default=16, help="images per validation")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run it on a GPU machine (benchmarks/gpu_suite.sh)")
    from kubetune_trainer.results.evaluation import ClipScorer

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)) for _ in range(args.images)]
    prompts = [f"a photo of thing number {i}" for i in range(args.images)]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        scorer = ClipScorer(str(write_clip_l(Path(tmp) / "clip-l")), torch.device(args.device))
        loaded = time.perf_counter() - started
    parameters = sum(p.numel() for p in scorer.model.parameters())
    score = timed(lambda: scorer.clip_score(images, prompts), args.repeats)
    directional = timed(lambda: scorer.clip_directional(images, images[::-1], prompts), args.repeats)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"CLIP ViT-L/14 architecture ({parameters / 1e6:.0f}M parameters, fp32, random weights), "
          f"{args.images} images of 512 px, device {device}")
    print(f"  written and loaded once          {loaded:.1f} s")
    print(f"  clip_score per validation        {score:.3f} s  ({args.images / score:.1f} images/s, "
          "model moved in and out included)")
    print(f"  clip_directional per validation  {directional:.3f} s  (twice the images)")


if __name__ == "__main__":
    main()
