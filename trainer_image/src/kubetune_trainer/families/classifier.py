"""Supervised image classification with any transformers image-classification model (full or LoRA)."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn.functional as F

from kubetune_trainer.checkpoint.sharded import STATE_DIR, saved_trained_weights
from kubetune_trainer.results.classification_metrics import classification_metrics
from kubetune_trainer.data.image_folder import read_labelled
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.trainable import transformers_classifier
from kubetune_trainer.families.components import Component


def image_processor(pretrained: str):
    """The model's image processor (its size and normalisation), or None when it ships none."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(pretrained)
    except (OSError, ValueError):
        return None


def native_size(processor, config) -> int | None:
    """The square size the model was trained at: its processor's crop or resize size, else config.image_size."""
    for attribute in ("crop_size", "size"):
        side = _side(getattr(processor, attribute, None))
        if side:
            return side
    image_size = getattr(config, "image_size", None)
    return int(image_size[0] if isinstance(image_size, (list, tuple)) else image_size) if image_size else None


def _side(size) -> int | None:
    """A processor's size: an int, or height / shortest_edge of a dict or transformers' SizeDict."""
    if isinstance(size, int):
        return size
    for key in ("height", "shortest_edge"):
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if value:
            return int(value)
    return None


class ImageClassifier(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        from transformers import AutoModelForImageClassification

        self.samples, self.classes = read_labelled(spec, self.screen)
        model = AutoModelForImageClassification.from_pretrained(
            spec.model.pretrained, num_labels=len(self.classes), ignore_mismatched_sizes=True,
            id2label=dict(enumerate(self.classes)), label2id={c: i for i, c in enumerate(self.classes)},
        )
        processor = image_processor(spec.model.pretrained)
        mean = getattr(processor, "image_mean", None) or getattr(model.config, "image_mean", None) or [0.5] * 3
        std = getattr(processor, "image_std", None) or getattr(model.config, "image_std", None) or [0.5] * 3
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)
        self.native_size = native_size(processor, model.config)
        if not isinstance(spec.data.resolution, (int, type(None))):
            raise ConfigError("spec.data.resolution: the classifier trains on square images; give one side")
        self.resolution = spec.data.resolution or self.native_size
        if self.resolution is None:
            raise ConfigError(f"spec.data.resolution: {spec.model.pretrained} says nothing of its image size "
                              "(no image processor, no config.image_size); set the resolution")
        self.size = (self.resolution, self.resolution)
        # A size the model was not built for: ViT-style models interpolate their position embeddings.
        self.forward_options = ({"interpolate_pos_encoding": True} if self.resolution != self.native_size
                                and "interpolate_pos_encoding" in inspect.signature(model.forward).parameters else {})
        self.trainable = transformers_classifier(model, spec.adapter)
        self.model = self.trainable.module.to(device).train()
        self._check_resolution()

    def _check_resolution(self) -> None:
        """Run one blank image through the model at the training resolution: a size it cannot take is
        refused here, naming the field, instead of failing inside the first step."""
        blank = torch.zeros(1, 3, self.resolution, self.resolution)
        try:
            with torch.no_grad():
                self.logits(self.model, blank)
        except (RuntimeError, ValueError) as err:
            reason = str(err).splitlines()[0][:200]
            raise ConfigError(
                f"spec.data.resolution: {self.spec.model.pretrained} takes {self.native_size}x{self.native_size} "
                f"images and cannot run at {self.resolution}x{self.resolution} ({reason}); leave "
                "spec.data.resolution unset to train at its own size, or use a model that interpolates its "
                "position embeddings (ViT, DeiT, BEiT...)") from None

    def read_samples(self):
        return self.samples  # read before the model: its head needs the classes

    def logits(self, model, pixels: torch.Tensor) -> torch.Tensor:
        pixels = ((pixels + 1) / 2 - self.mean) / self.std  # [-1, 1] -> the model's normalisation
        return model(pixel_values=to_device(pixels, self.device), **self.forward_options).logits

    def compute_loss(self, model, batch, random):
        logits = self.logits(model, batch["pixel_values"]).float()
        return F.cross_entropy(logits, to_device(batch["labels"], self.device))

    @torch.no_grad()
    def evaluate(self, model, batches):
        losses, predictions, labels = [], [], []
        for batch, _ in batches:
            logits = self.logits(model, batch["pixel_values"]).float()
            losses.append(F.cross_entropy(logits, batch["labels"].to(self.device)).item())
            predictions.append(logits.argmax(-1).cpu())
            labels.append(batch["labels"])
        metrics = classification_metrics(torch.cat(predictions), torch.cat(labels), len(self.classes))
        return {"loss": sum(losses) / len(losses), **metrics}

    # --- a trained model's predictions (kubetune evaluate) -------------------------------------

    evaluates_predictions = True

    def load_trained(self, weights: Path) -> torch.nn.Module:
        """The trained module with the weights of a pulled run folder (final weights: a transformers
        model or PEFT adapter folder; a checkpoint: its adapter, else its sharded state), in eval mode."""
        from safetensors.torch import load_file

        module = self.trainable.module
        adapter = weights / "adapter_model.safetensors"
        if adapter.is_file():
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(module, load_file(adapter))
            unexpected = result.unexpected_keys
        elif (weights / "model.safetensors").is_file():
            # from_pretrained: the file's names are transformers' saved ones, which may differ from the module's
            saved = type(module).from_pretrained(weights, dtype=torch.float32).state_dict()
            result = module.load_state_dict(saved, strict=False)
            unexpected = result.unexpected_keys + result.missing_keys  # a whole model: every name matches
        elif (weights / STATE_DIR).is_dir():
            unexpected = module.load_state_dict(saved_trained_weights(weights), strict=False).unexpected_keys
        else:
            raise ConfigError(f"{weights}: no classifier weights there (adapter_model.safetensors, "
                              f"model.safetensors or a checkpoint's {STATE_DIR}/)")
        if unexpected:
            raise ConfigError(f"{weights}: these weights are not of this job's model ({unexpected[:3]} ...); "
                              "was the run trained from another spec.model.pretrained or adapter?")
        return module.eval()

    @torch.no_grad()
    def predict(self, model, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the predicted class, its softmax probability) of each image."""
        probabilities = self.logits(model, pixels).float().softmax(-1).cpu()
        confidence, predicted = probabilities.max(-1)
        return predicted, confidence


# --- declarations: reference architecture, tiny model, planning ------------------------------------

VIT_B16 = dict(
    image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, num_labels=1000,
)
ARCHITECTURE = {"model": Component("", "transformers", "ViTForImageClassification", VIT_B16)}


def write_tiny_classifier(out_dir: Path, seed: int = 0) -> Path:
    """A ViT image classifier (2 labels; training replaces the head to fit the data's classes)."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=2,
    ))
    model.save_pretrained(out_dir, safe_serialization=True)
    # Real checkpoints ship their preprocessing: the size and normalisation the model expects.
    ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def meta_classifier(spec, models: dict[str, torch.nn.Module]) -> None:
    """The planner's classifier trains as ImageClassifier does: whole, or a PEFT LoRA with its head."""
    models["model"] = transformers_classifier(models["model"], spec.adapter).module


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's forward at spec.data.resolution, else the model's own size."""
    model = models["model"]
    batch, side = spec.training.batch_size, spec.resolution or model.config.image_size
    with autocast():
        logits = model(pixel_values=make((batch, 3, side, side), torch.float32)).logits
    return F.cross_entropy(logits.float(), make((batch,), torch.long))


DEFINITION = FamilyDefinition(
    family=ImageClassifier,
    architecture=ARCHITECTURE,
    trained="model",
    forward=planning_forward,
    write_tiny=write_tiny_classifier,
    auto_classes={"model": "AutoModelForImageClassification"},
    dtype_from_config=True,  # from_pretrained without a dtype, as ImageClassifier loads it
    meta_trainable=meta_classifier,
)
