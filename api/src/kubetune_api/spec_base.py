"""The base of every spec block: camelCase on the wire, unknown fields refused, strict types.

Its own module so that each area's blocks (spec_model, spec_data, spec_training, spec_resources, volumes,
spec_status) and spec.py, which gathers them into TrainingJobSpec, share it one way.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Base: camelCase aliases, unknown fields forbidden, values checked on assignment too."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        # Strict like the API server: "4" is not a batch size and "true" is not a boolean.
        strict=True,
    )
