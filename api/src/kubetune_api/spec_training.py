"""spec.training, spec.validation, spec.pmg and spec.checkpoints: optimisation and its length, held-out
evaluation and samples, PMG's options, and where checkpoints and the final weights go."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.spec_uris import ResumeSource, StorageUri


TRAINING_RULES = [
    Rule("has(self.maxSteps) != has(self.epochs)",
         lambda training: (training.max_steps is None) != (training.epochs is None),
         "set exactly one of spec.training.maxSteps or spec.training.epochs, not both"),
    Rule("self.optimizer != 'schedulefree-adamw' || self.lrScheduler == 'constant'",
         lambda training: training.optimizer != "schedulefree-adamw" or training.lr_scheduler == "constant",
         "spec.training.optimizer schedulefree-adamw replaces the schedule: set spec.training.lrScheduler to "
         "constant (lrWarmupSteps still applies)"),
    Rule("self.compileMode == 'default' || self.compile",
         lambda training: training.compile_mode == "default" or training.compile,
         "spec.training.compileMode applies with spec.training.compile: true; set compile: true or remove compileMode"),
]


class TrainingSpec(SpecModel):
    """How long and how to optimise. Give maxSteps or epochs."""

    model_config = ConfigDict(json_schema_extra=entries(TRAINING_RULES))

    max_steps: Optional[int] = Field(
        default=None, ge=1, le=10_000_000, description="Optimizer steps to train for."
    )
    epochs: Optional[int] = Field(
        default=None, ge=1, le=100_000, description="Passes over the data (instead of maxSteps)."
    )
    batch_size: int = Field(default=1, ge=1, le=4096, description="Samples per process per micro-batch.")
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, le=1024, description="Micro-batches accumulated per optimizer step."
    )
    learning_rate: float = Field(default=1e-4, gt=0, le=1, description="Peak learning rate (> 0).")
    lr_scheduler: Literal["constant", "linear", "cosine", "cosine-restarts", "step", "plateau"] = Field(
        default="constant",
        description="Learning-rate schedule after warmup: constant; linear or cosine decay; cosine-restarts "
        "(lrCycles cosine cycles); step (times lrGamma every lrStepSize steps); plateau (times lrGamma "
        "after lrPlateauPatience steps without a lower loss).",
    )
    lr_cycles: int = Field(default=1, ge=1, le=1000, description="cosine-restarts: number of cosine cycles.")
    lr_step_size: int = Field(default=1000, ge=1, le=10_000_000, description="step: optimizer steps between decays.")
    lr_gamma: float = Field(default=0.1, gt=0, le=1, description="step and plateau: factor applied at each decay.")
    lr_plateau_patience: int = Field(
        default=10, ge=1, le=1_000_000,
        description="plateau: losses (validation loss when validation runs, else training loss) without "
        "improvement before a decay.",
    )
    lr_warmup_steps: int = Field(
        default=0, ge=0, le=10_000_000, description="Optimizer steps of linear warmup from 0."
    )
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "lion", "sgd", "schedulefree-adamw"] = Field(
        default="adamw",
        description="Optimizer: adamw; adamw8bit (CUDA + bitsandbytes); prodigy (learning-rate free: use "
        "learningRate 1.0); lion (use a 3-10x smaller learning rate); sgd (with sgdMomentum); "
        "schedulefree-adamw (needs no schedule: lrScheduler must be constant).",
    )
    sgd_momentum: float = Field(default=0.9, ge=0, lt=1, description="sgd: momentum.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(default=1e-8, gt=0, le=1, description="AdamW epsilon.")
    weight_decay: float = Field(default=1e-2, ge=0, le=1, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(
        default=1.0, ge=0, le=1e6, description="Clip gradients to this global norm; 0 disables clipping."
    )
    max_grad_value: Optional[float] = Field(
        default=None, gt=0, le=1e6,
        description="Clip every gradient element to [-maxGradValue, maxGradValue] (before the norm clipping); "
        "unset = no clipping by value.",
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="no", description='Mixed precision: "no" (fp32), fp16 (GPU only) or bf16.'
    )
    seed: int = Field(default=42, ge=0, le=2**32 - 1, description="Seed for weights init, data order and noise.")
    snr_gamma: Optional[float] = Field(
        default=None, gt=0, le=100,
        description="Min-SNR loss weighting gamma (5.0 is the usual value); unset = plain MSE.",
    )
    noise_offset: float = Field(default=0.0, ge=0, le=1, description="Offset noise strength (0 disables).")
    log_every_steps: int = Field(default=1, ge=1, le=100_000, description="Log loss and lr every N steps.")
    ema_decay: Optional[float] = Field(
        default=None, gt=0, lt=1,
        description="Keep an exponential moving average of the trained weights with this decay (e.g. 0.999); "
        "the saved weights are the average. Unset = no EMA.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, about 30% slower.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the trained model's repeated blocks (regional compilation: each block class is "
        "compiled once and reused; the log states the compile time). The first step is slow; every bucket "
        "shape compiles once.",
    )
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = Field(
        default="default",
        description="With compile: default; max-autotune-no-cudagraphs (longer compile, faster kernels); "
        "reduce-overhead (CUDA graphs: least launch overhead, a GPU only).",
    )
    attention: Literal["auto", "sdpa", "flash3"] = Field(
        default="auto",
        description="Attention kernel on a GPU: auto (FlashAttention 3 on a Hopper GPU whose image has its "
        "kernels, else PyTorch SDPA's flash / memory-efficient kernels); sdpa; flash3 (refused where absent). "
        "The log states the choice.",
    )
    debug_overfit_batch: bool = Field(
        default=False,
        description="Debug mode: train on the first batch only, again and again; the loss should go to ~0.",
    )
    profile_steps: Optional[int] = Field(
        default=None, ge=1, le=1000,
        description="Record a torch profiler trace of this many steps (after 1 warm-up step) into "
        "<spec.checkpoints.uri>/profile, readable by TensorBoard and Perfetto.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "TrainingSpec":
        return enforce(TRAINING_RULES, self, info)


class ValidationSpec(SpecModel):
    """Held-out evaluation and sample images during training."""

    every_steps: Optional[int] = Field(
        default=None, ge=1, le=10_000_000,
        description="Validate every N optimizer steps and at the end; unset = no validation.",
    )
    held_out_fraction: float = Field(
        default=0.0, ge=0.0, le=0.5,
        description="Fraction of the data (chosen by file-name hash, stable across runs) kept out of "
        "training for the held-out loss and metrics (0-0.5).",
    )
    prompts: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        default_factory=list, max_length=16,
        description="Text-to-image families: prompts sampled as images at each validation. Edit families "
        "sample the first held-out (else training) pairs instead.",
    )
    num_samples: int = Field(
        default=2, ge=0, le=16, description="Held-out samples drawn as images at each validation: by edit "
        "families always, by text-to-image families (their captions) when clipModel is set and prompts are "
        "not (0 = none).",
    )
    num_inference_steps: int = Field(default=20, ge=1, le=1000, description="Denoising steps of sample images.")
    guidance_scale: Optional[float] = Field(
        default=None, ge=0, le=100,
        description="Guidance of the sample images: the classifier-free guidance scale, or the distilled guidance "
        "of the FLUX families. Unset: the family's default (docs/families.md).",
    )
    clip_model: Optional[StorageUri] = Field(
        default=None,
        description="A CLIP model that scores the images sampled at each validation (same seed every time): "
        "a local path, an s3:// URI or a hub id (e.g. openai/clip-vit-large-patch14) in the transformers "
        "layout. Text-to-image families report clip_score, 100 x the mean cosine of image "
        "and prompt; edit families report clip_directional, the cosine of the edit's image direction and its "
        "instruction's text direction.",
    )
    monitor: Literal["loss", "accuracy", "precision", "recall", "f1", "clip_score", "clip_directional"] = Field(
        default="loss",
        description="Metric for early stopping and keepBest: held-out loss (lower is better), the "
        "classifier's accuracy or macro precision, recall or F1, or clip_score / clip_directional with "
        "clipModel (higher is better).",
    )
    early_stopping_patience: Optional[int] = Field(
        default=None, ge=1, le=100_000,
        description="Stop after this many validations without improvement of the monitored metric.",
    )
    keep_best: Optional[int] = Field(
        default=None, ge=1, le=100,
        description="Keep the weights of the K best validations by the monitored metric under "
        "<spec.checkpoints.uri>/best/.",
    )


# A file under spec.data.uri: relative, each segment starting with a letter, digit, _ or - (so no
# '.', '..' or hidden names); the pattern is the whole rule, for the API server and Python alike.
DataFileName = Annotated[str, Field(
    min_length=1, max_length=1024, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$",
)]

PMG_RULES = [
    Rule("!has(self.prefixHiddenSize) || (has(self.prefixProjection) && self.prefixProjection)",
         lambda pmg: pmg.prefix_hidden_size is None or pmg.prefix_projection,
         "spec.pmg.prefixHiddenSize sizes the prefix projection: set spec.pmg.prefixProjection true, or remove it"),
]


class PmgSpec(SpecModel):
    """PMG (personalized generation) options; only for spec.model.family pmg."""

    model_config = ConfigDict(json_schema_extra=entries(PMG_RULES))

    language_model: Optional[StorageUri] = Field(
        default=None,
        description="The frozen LLaMA-style causal LM (transformers layout). Unset = "
        "<spec.model.pretrained>/language_model.",
    )
    num_image_prompt: int = Field(
        default=2, ge=1, le=256, description="Trainable image-prompt tokens appended after the user's history.",
    )
    num_prefix_prompt: int = Field(
        default=2, ge=1, le=256, description="Length of the P-Tuning v2 prefix fed to every LM layer.",
    )
    max_sequence_length: int = Field(
        default=256, ge=8, le=8192, description="Tokens of user history the LM reads (longer is truncated).",
    )
    prefix_projection: bool = Field(
        default=False,
        description="P-Tuning v2's reparameterisation: produce the prefix through a two-layer MLP instead of "
        "training each layer's key/value prefix directly. Costly: at LLaMA-2-7B dimensions the MLP's last layer "
        "alone holds prefixHiddenSize x 262,144 weights (about 1.1 billion at the default size).",
    )
    prefix_hidden_size: Optional[int] = Field(
        default=None, ge=1, le=65536,
        description="prefixProjection only: the MLP's hidden size. Unset = the LM's hidden size.",
    )
    train_json: DataFileName = Field(
        default="data.json",
        description="The training records, a JSON list under spec.data.uri: {user_id, history: [texts], "
        "target_image, target_caption}, or the PMG guide's processed form {user_id or worker_id, "
        "history_items_info: [{caption, ...}], target_item_info: {caption, image_path}} (e.g. "
        "processed_dataset/train.json of FLICKR, POG or SER; image paths relative to spec.data.uri).",
    )
    val_json: Optional[DataFileName] = Field(
        default=None,
        description="Held-out records in the same form (e.g. processed_dataset/val.json), validated every "
        "spec.validation.everySteps; unset = spec.validation.heldOutFraction of trainJson.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "PmgSpec":
        return enforce(PMG_RULES, self, info)


class CheckpointSpec(SpecModel):
    """Where checkpoints and the final adapter go, how often, and how many to keep."""

    uri: StorageUri = Field(description="Checkpoint directory: a local path or s3://bucket/prefix.")
    every_steps: int = Field(default=500, ge=1, le=10_000_000, description="Save a checkpoint every N optimizer steps.")
    keep_last: int = Field(default=3, ge=1, le=1000, description="Checkpoints to keep; older ones are deleted.")
    resume_from: Optional[ResumeSource] = Field(
        default=None,
        description="Where a new run starts. Unset: from scratch. latest: from the newest complete checkpoint "
        "of this job's earlier runs. A URI: that checkpoint, e.g. s3://bucket/prefix/ns/job/v0/checkpoint-500. "
        "A restarted pod of the same run always continues its own newest checkpoint.",
    )
