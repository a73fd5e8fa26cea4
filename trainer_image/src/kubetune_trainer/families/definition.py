"""How to add a family: one module and one row. Read this first.

1. Its row in kubetune_api.families (FamilyInfo, torch-free): its name in spec.model.family, the
   layouts it reads, its native resolution, the metrics it reports, the options it honours, its fit
   profile for the operator (`python -m kubetune_trainer.planning.profiles NAME` prints it), and
   whether it trains parts of its own (own_adapter) or owns an options block (options).
2. Its module kubetune_trainer/families/<name, "-" as "_">.py (the registry finds it by that name):
   its ModelFamily subclass (families.base: load, encode, loss, save, sample, frozen_models) and,
   at the end, `DEFINITION = FamilyDefinition(...)`: everything else the trainer derives its lists
   from. Nothing outside the module asks which family it is: the registry (families.definition_for,
   family_for), the planner (planning.models / estimate / profiles), the reference architectures and
   config-only folders (reference_models), the tiny models (tiny_models.write_tiny_model, `kubetune
   dev tiny-model`) and the benchmarks all read DEFINITION.

Besides: tests (tests/trainer/test_families.py trains every family's tiny model), an example
manifest in manifests/examples/, and `python -m kubetune_api.families > docs/families.md`. A family
whose data no layout reads yet needs a new layout first: kubetune_api.data_layouts says how to add one
(its twin of this recipe).

Shared behaviour is composed from parts, never inherited from another family: a diffusers denoiser
loaded (quantized) and trained (families.denoiser), Stable Diffusion's parts (families.stable_diffusion:
the UNet, its VAE and a text part; sd15, sdxl and pmg compose them), the editing families' validation
(families.editing), published component configs shared by several models (families.components: CLIP,
T5, Qwen2.5-VL, the SD VAE), the planning forward helpers (families.planning_forwards) and the tiny-model
helpers (tiny_models: tokenizers, a tiny VAE and UNet).

Importing a family module must stay cheap (the planner and the CLI import it to read DEFINITION):
diffusers, transformers and peft are imported inside functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch

    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.families.base import ModelFamily
    from kubetune_trainer.results.lora_keys import LoraKeyConvention
    from kubetune_trainer.families.components import Component

Models = dict[str, "torch.nn.Module"]
# The training forward for the planner: (models by component name, on the meta or a fake device;
# spec; make(shape, dtype) -> an input tensor; autocast() -> the context the trained module runs in;
# the weight dtype) -> the loss. It mirrors the family's compute_loss on inputs of the shapes the
# encoders would give (they are not run): see families.planning_forwards.
Forward = Callable[..., "torch.Tensor"]
ModelWriter = Callable[..., Path]  # (out_dir, seed=0) -> out_dir, the folder from_pretrained reads


@dataclass(frozen=True)
class FamilyDefinition:
    """What the trainer side derives from a family besides its ModelFamily class."""

    family: type[ModelFamily]                # the class the run trains with (family_for)
    # The reference architecture: the published model's components by name, each with its subfolder,
    # class and config values (families.components.Component). `kubetune plan` builds them on the meta
    # device from a folder's config files; benchmarks build them with random weights.
    architecture: Mapping[str, Component]
    trained: str                             # the component DDP wraps / FSDP shards (PMG: "adapter", its own)
    forward: Forward                         # the planner's training forward (see Forward above)
    write_tiny: ModelWriter                  # a tiny random-weight model in the family's folder layout
    write_full_size: ModelWriter | None = None  # the real architecture, random weights (`--full-size`)
    quantized: str | None = None             # the frozen denoiser spec.model.quantization applies to
    # A diffusers pipeline: its class name (model_index.json; the family saves its LoRA for it), the scheduler and
    # tokenizers/processors a config-only folder ships, extra model_index.json entries, and components
    # that sit beside the pipeline rather than in it (PMG's language model). None: a transformers model.
    pipeline: str | None = None
    scheduler: Callable[[], Any] | None = None
    write_tokenizers: Callable[[Path], None] | None = None
    model_index: Mapping[str, Any] = field(default_factory=dict)
    beside_pipeline: frozenset[str] = frozenset()
    # Planning: components built through a transformers Auto class (the config names the architecture);
    # components a spec field may load from elsewhere than spec.model.pretrained/<subfolder>:
    # name -> (the field as messages name it, spec -> its value or None).
    auto_classes: Mapping[str, str] = field(default_factory=dict)
    elsewhere: Mapping[str, tuple[str, Callable[[TrainingJobSpec], str | None]]] = field(default_factory=dict)
    dtype_from_config: bool = False          # loads without a dtype: the config's, else fp32 (transformers)
    # How planning makes the meta models trainable and checkpoints them, where the defaults (below) do not fit.
    meta_trainable: Callable[[TrainingJobSpec, Models], None] | None = None
    checkpointing: Callable[[Models], None] | None = None
    # `kubetune export`: the key names its non-diffusers tools (ComfyUI, kohya) read its LoRA in, where
    # such a convention exists and diffusers' own loader for `pipeline` reads it back (lora_keys); and
    # the LoRA files it writes besides pytorch_lora_weights.safetensors, each with the extra
    # load_lora_weights arguments that load it into its pipeline (Wan's low-noise expert).
    kohya: LoraKeyConvention | None = None
    other_lora_files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def make_trainable(self, spec: TrainingJobSpec, models: Models) -> None:
        """What the family trains, added to its meta models as the family does (after everything was
        frozen). Default: the diffusers denoiser `trained`, whole or as a LoRA (families.trainable)."""
        if self.meta_trainable is not None:
            self.meta_trainable(spec, models)
            return
        from kubetune_trainer.families.trainable import diffusers_denoiser

        # Nothing is saved from a meta model: no pipeline to save with, no initFrom to read.
        diffusers_denoiser(models[self.trained], spec.adapter, self.trained, pipeline=None, load_init=False)

    def enable_gradient_checkpointing(self, models: Models) -> None:
        """As the family's ModelFamily.enable_gradient_checkpointing does. Default: the trained module."""
        if self.checkpointing is not None:
            self.checkpointing(models)
            return
        from kubetune_trainer.families.trainable import enable_gradient_checkpointing

        enable_gradient_checkpointing(models[self.trained])

    def load_dtype(self, spec: TrainingJobSpec, name: str, config: dict, dtype: torch.dtype) -> torch.dtype:
        """The dtype component `name` loads in, as the family loads it: the training precision, fp32
        for a fully trained denoiser (autocast computes in low precision), or the config's."""
        import torch

        if self.dtype_from_config:
            return getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
        if name == self.trained and spec.adapter.type == "full":
            return torch.float32
        return dtype
