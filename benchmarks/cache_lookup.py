"""What a cached training step costs the host: EmbeddingCache.encode for a batch whose latents are
all in the cache (the work the training process does instead of running the VAE).

    .venv/bin/python benchmarks/cache_lookup.py                  # batch 8, 3x512x512 pixels
    .venv/bin/python benchmarks/cache_lookup.py --batch-size 1

Prints milliseconds per lookup of the whole batch (with each image's mirror variant, as a job with
spec.data.randomFlip does; the mirrors are looked up the first time an image is seen) and the parts:
hashing the pixels, flipping them. Not a test.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kubetune_trainer.data.cache import EmbeddingCache, Encoder, LocalStore, content_hash


def milliseconds(work, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - started) / repeats * 1000


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    pixels = [torch.rand(3, args.resolution, args.resolution) for _ in range(args.batch_size)]
    latent = args.resolution // 8
    encoder = Encoder("latents", "benchmark", lambda batch: {"moments": torch.randn(len(batch), 8, latent, latent)})
    with tempfile.TemporaryDirectory() as root:
        cache = EmbeddingCache(LocalStore(Path(root)))
        cache.encode(encoder, pixels, [[p.flip(-1)] for p in pixels])  # fill
        lookup = milliseconds(lambda: cache.encode(encoder, pixels, [[p.flip(-1)] for p in pixels]), args.repeats)
    hashing = milliseconds(lambda: [content_hash(p) for p in pixels], args.repeats)
    flipping = milliseconds(lambda: [p.flip(-1) for p in pixels], args.repeats)
    print(f"batch {args.batch_size}, 3x{args.resolution}x{args.resolution} pixels, every entry cached, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"  cached lookup, with mirror variants  {lookup:8.1f} ms")
    print(f"  of which hashing the pixels          {hashing:8.1f} ms (their mirrors: hashed once per process)")
    print(f"  of which flipping them               {flipping:8.1f} ms")


if __name__ == "__main__":
    main()
