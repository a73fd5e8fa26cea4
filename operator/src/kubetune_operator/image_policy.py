"""Which trainer images a TrainingJob may name (the chart's trainer.allowedImagePrefixes).

Whoever may create a TrainingJob chooses the image of pods the operator creates for them, with
the pods' ServiceAccount and the job's S3 credentials. A platform team that lists the registries it
trusts gets jobs naming any other image refused: at admission, and again when the operator
reconciles (the webhook fails open while the operator is down). The operator's default image is
always allowed: the chart chose it.
"""
from __future__ import annotations

CONDITION = "ImageAllowed"
# A prefix that ends with one of these is matched as written; any other names a registry, a
# repository path or an image, matched whole: "ghcr.io/team" admits "ghcr.io/team/x:1" and
# "ghcr.io/team:1", never "ghcr.io/team-evil/x".
SEPARATORS = ("/", ":", "@")


def parse_prefixes(text: str) -> tuple[str, ...]:
    """KUBETUNE_ALLOWED_IMAGE_PREFIXES: comma-separated; empty = every image allowed."""
    return tuple(prefix.strip() for prefix in text.split(",") if prefix.strip())


def allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    for prefix in prefixes:
        if prefix.endswith(SEPARATORS):
            if image.startswith(prefix):
                return True
        elif image == prefix or any(image.startswith(prefix + separator) for separator in SEPARATORS):
            return True
    return False


def refusal(image: str | None, prefixes: tuple[str, ...], default_image: str) -> str | None:
    """Why spec.image may not be used here, or None (none named, the default, no list, or on it)."""
    if not image or image == default_image or not prefixes or allowed(image, prefixes):
        return None
    return (f"spec.image: {image!r} is not from a registry this cluster allows ({', '.join(prefixes)}; "
            "Helm value trainer.allowedImagePrefixes); use an image under one of them, or leave spec.image "
            "unset for the operator's default trainer image")
