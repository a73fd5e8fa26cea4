"""The trainer on models built from their configs with random weights: a benchmark stand-in.

    python -m kubetune_trainer.models.random_weights --config JOB.yaml [--cache-only] [--build-device cuda]

GPU benchmarks measure speed and memory at the real architecture, which do not depend on the
weights' values; but FLUX.2 [dev] with its text encoder is ~112 GB in bf16 and Qwen-Image ~58 GB,
more than the lent GPU machines' 64 GiB disks hold. So a benchmark writes the family's configs
only (reference_models.write_config_only) and runs the real trainer through this module: every
`from_pretrained` of a local folder that holds a config and no weight file builds the model from
that config instead, in the dtype asked for, on --build-device (a GPU initialises billions of
parameters in seconds; a CPU takes minutes), seeded, and hands it back on the CPU, where
`from_pretrained` would have put it, so the trainer places it as it would loaded weights. A folder
with weights loads as usual. Each built model is logged as a stand-in; nothing else changes.

Not for training anything: the operator never runs this module.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("kubetune.trainer")

# What a saved model's weights are called, by either library (sharded ones have an index beside).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# from_pretrained's arguments about reading files, not about the model: a built model ignores them.
LOADING_ARGUMENTS = {"subfolder", "torch_dtype", "dtype", "variant", "use_safetensors", "low_cpu_mem_usage",
                     "device_map", "ignore_mismatched_sizes", "revision", "cache_dir", "local_files_only", "token",
                     "trust_remote_code", "config", "attn_implementation"}


def has_weights(folder: Path) -> bool:
    return any(path.suffix in WEIGHT_SUFFIXES for path in folder.iterdir())


def config_only_folder(path, subfolder: str | None) -> Path | None:
    """The local folder a from_pretrained call reads, when it holds no weights (else None: load it)."""
    if not isinstance(path, (str, Path)):
        return None
    folder = Path(path) / (subfolder or "")
    return folder if folder.is_dir() and not has_weights(folder) else None


def requested_dtype(kwargs: dict, config_dtype) -> torch.dtype:
    """The dtype from_pretrained would give: the one asked for, "auto" the config's, else float32."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype == "auto":
        dtype = config_dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created in `dtype` from the start: a 32B model never exists in float32 (128 GB)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_diffusers(cls, path, kwargs: dict) -> torch.nn.Module:
    config = cls.load_config(path, subfolder=kwargs.get("subfolder"))
    with default_dtype(requested_dtype(kwargs, None)):
        return cls.from_config(config)


def build_transformers(cls, path, kwargs: dict) -> torch.nn.Module:
    """As from_pretrained: a given config object (the Auto classes pass one), else the folder's,
    with from_pretrained's own config overrides (e.g. a classifier's num_labels) applied."""
    config = kwargs.get("config")
    if config is None:
        overrides = {key: value for key, value in kwargs.items() if key not in LOADING_ARGUMENTS}
        config = cls.config_class.from_pretrained(path, subfolder=kwargs.get("subfolder") or "", **overrides)
    extra = {"attn_implementation": kwargs["attn_implementation"]} if "attn_implementation" in kwargs else {}
    return cls._from_config(config, dtype=requested_dtype(kwargs, getattr(config, "dtype", None)), **extra)


def build(cls, path, kwargs: dict, build_device: str, seed: int) -> torch.nn.Module:
    """The model from its configs, random weights on `build_device`, handed back on the CPU."""
    if kwargs.get("quantization_config") is not None:
        from kubetune_trainer.errors import ConfigError

        raise ConfigError(f"{cls.__name__} from {path}: random weights are built, not loaded, so they cannot be "
                         "quantized while loading (nf4); benchmark with spec.model.quantization fp8 or none")
    import diffusers

    started = time.perf_counter()
    devices = [torch.device(build_device)] if torch.device(build_device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the trainer's own random state is left as it was
        torch.manual_seed(seed)
        with torch.device(build_device):
            if issubclass(cls, diffusers.ModelMixin):
                model = build_diffusers(cls, path, kwargs)
            else:
                model = build_transformers(cls, path, kwargs)
    model.eval()  # as from_pretrained returns it
    model.to("cpu")
    if devices:
        # The build's GPU memory is not the run's: the trainer reports its peak from here on.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    parameters = sum(p.numel() for p in model.parameters())
    count = f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.2f}M"
    log.info("random weights (a benchmark stand-in for %s): %s, %s parameters in %s, built on %s in %.1f s",
             Path(path) / (kwargs.get("subfolder") or ""), cls.__name__, count,
             next(model.parameters()).dtype, build_device, time.perf_counter() - started)
    return model


@contextlib.contextmanager
def built_from_configs(build_device: str, seed: int = 0):
    """Within: from_pretrained of a config-only folder builds the model (see the module's text)."""
    import diffusers
    import transformers

    bases = (diffusers.ModelMixin, transformers.PreTrainedModel)
    originals = {base: base.__dict__["from_pretrained"] for base in bases}

    def patched(original):
        def from_pretrained(cls, path, *args, **kwargs):
            if args or config_only_folder(path, kwargs.get("subfolder")) is None:
                return original.__func__(cls, path, *args, **kwargs)
            return build(cls, path, kwargs, build_device, seed)
        return classmethod(from_pretrained)

    for base, original in originals.items():
        base.from_pretrained = patched(original)
    try:
        yield
    finally:
        for base, original in originals.items():
            base.from_pretrained = original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.models.random_weights", description=__doc__)
    parser.add_argument("--build-device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the random weights are initialised (default: the GPU if there is one)")
    parser.add_argument("--seed", type=int, default=0)
    args, trainer_argv = parser.parse_known_args(argv)
    from kubetune_trainer.__main__ import main as trainer_main

    with built_from_configs(args.build_device, args.seed):
        return trainer_main(trainer_argv)


if __name__ == "__main__":
    sys.exit(main())
