"""How the processes share the trained model: DDP (replicas) or FSDP2 (shards), behind one interface.

Everything the loop does that differs between the two lives here: wrapping the module and
building its optimizer, accumulating gradients without a collective, backward, clipping, and
unwrapping. Checkpoints do not differ: both go through torch.distributed.checkpoint's
state-dict API (see checkpoint/sharded.py), which is also what lets a run resume under the other one.

DDP goes through Accelerate (autocast for mixed precision, the fp16 loss scaler). FSDP calls
torch's `fully_shard` itself, as Accelerate's FSDP2 plugin does, because Accelerate enables FSDP
only on GPU process groups and the same code must train, and be tested, on CPUs over gloo.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.errors import ConfigError

log = logging.getLogger("kubetune.trainer")
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one, innermost first: modules whose class the model lists in
    `_no_split_modules` (diffusers and transformers both declare their blocks there; some nest,
    e.g. a UNet's up block holds resnet and transformer blocks, and an outer unit takes only
    what its inner units left)."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    outer_first = [sub for sub in module.modules() if type(sub).__name__ in names and sub is not module]
    return outer_first[::-1]


class DataParallel:
    """Every process holds the whole model; gradients are averaged after the last micro-batch."""

    sharded = False

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def prepare(self, module: torch.nn.Module, make_optimizer: OptimizerFactory):
        optimizer = make_optimizer([p for p in module.parameters() if p.requires_grad])
        return self.accelerator.prepare(module, optimizer)

    def no_sync(self, model):
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, model, max_norm: float) -> None:
        self.accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)

    def unwrap(self, model) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model)

    def describe(self) -> str:
        return "ddp"


class FullySharded:
    """Parameters, gradients and optimizer state sharded over every process (FSDP2).

    Each block listed by the model's `_no_split_modules` is a unit, all-gathered just before it
    runs and freed after (reshard_after_forward), so a process holds one block whole at a time.
    Frozen and trained parameters shard alike, so a LoRA on a 12B transformer keeps 1/N of the
    base weights per GPU. Mixed precision: parameters are cast to the training precision for
    compute, gradients reduced in fp32; trained weights stay fp32 in the shards.
    """

    sharded = True

    def __init__(self, spec: TrainingJobSpec, device: torch.device):
        self.spec = spec
        self.device = device
        if spec.distributed.cpu_offload and device.type != "cuda":
            raise ConfigError("spec.distributed.cpuOffload needs CUDA GPUs: on the CPU everything is in CPU memory already")

    def prepare(self, module: torch.nn.Module, make_optimizer: OptimizerFactory):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        compute = PRECISIONS[self.spec.training.mixed_precision]
        options = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None),
            "offload_policy": CPUOffloadPolicy() if self.spec.distributed.cpu_offload else OffloadPolicy(),
            "reshard_after_forward": True,
        }
        units = shard_units(module)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(module, **options)  # the rest: embeddings, norms, heads
        log.info("fsdp: %s sharded as %d block(s) + the root", type(module).__name__, len(units))
        optimizer = make_optimizer([p for p in module.parameters() if p.requires_grad])
        return module, optimizer

    @contextmanager
    def no_sync(self, model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, model, max_norm: float) -> None:
        # The norm of sharded gradients is reduced over all shards (DTensor), as clipping needs.
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)

    def unwrap(self, model) -> torch.nn.Module:
        return model  # fully_shard changes the module in place

    def describe(self) -> str:
        return "fsdp" + (" with CPU offload" if self.spec.distributed.cpu_offload else "")


def build_parallel(strategy: str, spec: TrainingJobSpec, accelerator) -> DataParallel | FullySharded:
    if strategy == "fsdp":
        return FullySharded(spec, accelerator.device)
    return DataParallel(accelerator)

