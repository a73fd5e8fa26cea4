"""Drop known warnings of libraries that say nothing about a kubetune run.

diffusers imports bitsandbytes and torchao whenever they are installed, so every trainer process
would otherwise start its log with three of them; a fourth comes with every FLUX.2 [dev] prompt
encoded. Each filter drops one known message from one logger;
everything else those loggers say still shows.
"""
from __future__ import annotations

import logging

KNOWN = {
    # bitsandbytes looks for an optional CPU 4-bit kernel on the Hugging Face hub; nf4 runs on CUDA.
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    # torchao registers enums with torch.compile that torch 2.15 handles by itself.
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
    # diffusers' loader for torchao-serialized checkpoints; kubetune quantizes after loading instead.
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
    # diffusers' Flux2Pipeline passes the padding options the older way, at every prompt; transformers applies them.
    "transformers.processing_utils": "have to be in `processor_kwargs` dict",
}


class DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def install() -> None:
    """Idempotent: a logger gets its filter once."""
    for name, fragment in KNOWN.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(DropMessage(fragment))
