"""spec.model and spec.adapter: the base model (family, weights, quantization, encoders) and what is trained."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kubetune_api.families import FAMILY_NAMES
from kubetune_api.hub import HUB_ID, looks_like_hub_id
from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.spec_uris import StorageUri, _STORAGE_URI_FORMS, _STORAGE_URI_RULE


Family = Literal[FAMILY_NAMES]


MODEL_RULES = [
    Rule(f"!has(self.revision) || self.pretrained.matches('^{HUB_ID.pattern}$')",
         lambda model: model.revision is None or looks_like_hub_id(model.pretrained),
         "spec.model.revision names a tag, branch or commit of a hub model: make spec.model.pretrained a hub id "
         "(org/name), or remove the revision"),
]


class ModelSpec(SpecModel):
    """Which model family to train and where its pretrained weights are."""

    model_config = ConfigDict(json_schema_extra=entries(MODEL_RULES))

    family: Family = Field(
        description="Model family: " + ", ".join(FAMILY_NAMES) + "."
    )
    pretrained: StorageUri = Field(
        description="Pretrained weights: a local path, an s3:// URI, or a model-hub id "
        "(e.g. org/name), in the family's standard (diffusers/transformers) folder layout."
    )

    quantization: Optional[Literal["fp8", "nf4"]] = Field(
        default=None,
        description="Load the frozen base weights quantized to save GPU memory: fp8 (a CUDA GPU of "
        "compute capability 8.9+) or nf4 (a CUDA GPU with bitsandbytes). Unset = the training precision.",
    )
    vae: Optional[StorageUri] = Field(
        default=None,
        description="A VAE to encode and decode with instead of the model's own: a local path, an s3:// URI or a "
        "hub id of a VAE folder (or of a model folder holding vae/), e.g. SDXL's fp16-fix VAE. Its latent "
        "channels must be the model's own VAE's. Unset: <pretrained>/vae.",
    )
    encoder_device: Literal["auto", "gpu", "cpu"] = Field(
        default="auto",
        description="Where the frozen text encoders and VAE live during training on a GPU: auto (on the CPU when "
        "spec.data.cache is enabled, since training steps then read their outputs from the cache, else on the "
        "GPU); gpu; cpu (needs the cache). They come to the GPU for filling the cache and for validation "
        "samples, and leave it after.",
    )
    experts: Optional[Literal["high-noise", "low-noise", "both"]] = Field(
        default=None,
        description="A two-expert model (Wan 2.2 A14B: transformer for high noise, transformer_2 for low noise, "
        "split at its boundary_ratio): which expert trains, on the noise levels it denoises: high-noise, "
        "low-noise, or both (each sample goes to the expert of its noise level). Unset: every expert the model "
        "has. A one-expert model refuses it.",
    )
    revision: Optional[str] = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="For a model-hub id in pretrained: the tag, branch or commit to train from (unset: main). A "
        "branch is resolved to its commit at the run's first start and recorded in the run, so every node and every "
        "restart reads the same files.",
    )
    hub_token_secret: Optional[str] = Field(
        default=None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A Secret in the job's namespace whose key HF_TOKEN is the model hub's access token, for gated "
        "or private hub models (pretrained, vae, spec.validation.clipModel). It reaches only the process that "
        "downloads, as a secretKeyRef: never the ConfigMap, an argument, a log or the status.",
    )
    mirror_uri: Optional[StorageUri] = Field(
        default=None,
        description="An s3:// prefix where hub models are mirrored: the first pod that needs a (model, commit) "
        "downloads it once from the hub into <mirrorUri>/hub/<org>/<name>/<commit>/, every other pod, job and "
        "restart reads it from there. Unset: the operator's models.mirrorUri; unset there too, each pod downloads.",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"self.startsWith('s3://') && ({_STORAGE_URI_RULE})",
            "message": f"mirrorUri is an s3:// prefix: s3://bucket/prefix ({_STORAGE_URI_FORMS})"}]},
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "ModelSpec":
        return enforce(MODEL_RULES, self, info)

    @field_validator("mirror_uri")
    @classmethod
    def _mirror_on_s3(cls, value: Optional[str]) -> Optional[str]:
        # Every pod of every job must reach the mirror: a local path is one node's disk.
        if value is not None and not value.startswith("s3://"):
            raise ValueError("mirrorUri is an s3:// prefix (s3://bucket/prefix): every pod must reach it")
        return value


class AdapterSpec(SpecModel):
    """What is trained: a LoRA adapter on the base model, or all of its weights."""

    type: Literal["lora", "full"] = Field(
        default="lora", description="lora trains a low-rank adapter; full trains every weight."
    )
    rank: int = Field(default=8, ge=1, le=1024, description="LoRA rank r (1-1024).")
    alpha: Optional[float] = Field(
        default=None, gt=0, le=4096,
        description="LoRA alpha; the update is scaled by alpha/rank. Defaults to the rank.",
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input (0-1).")
    target_modules: Optional[list[Annotated[str, Field(min_length=1, max_length=253)]]] = Field(
        default=None, max_length=64,
        description="Module names that get LoRA layers; defaults to the family's attention projections.",
    )
    init_from: Optional[StorageUri] = Field(
        default=None,
        description="Start the LoRA from existing weights: a directory holding "
        "pytorch_lora_weights.safetensors, or the file. Its rank and target modules must match.",
    )
    save_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        default=None,
        description="Precision of the weights files written (final and per checkpoint): fp32, bf16 or fp16. "
        "Unset = the training precision (spec.training.mixedPrecision; fp32 for \"no\"). Training and "
        "resuming always keep fp32 weights.",
    )
