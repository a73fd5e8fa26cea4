"""A request for images drawn on the cluster (`kubetune generate --on-cluster`), as the CLI writes it
into the TrainingJob's annotation (contract.GENERATE_ANNOTATION) and the operator reads it back.

Torch-free and kopf-free: the CLI writes it, the operator renders the pod's arguments from it, and the
pod (kubetune_trainer.results.generation_pod) parses those arguments with the same names.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from kubetune_api import layout
from kubetune_api.contract import GENERATED_FOLDER

ID_PATTERN = re.compile(r"[a-z0-9]{1,12}")  # part of a Job name (<40>-generate-<12> <= 63) and a label


class BadGenerationRequest(ValueError):
    """An annotation the operator cannot act on, in one line."""


@dataclass(frozen=True)
class GenerationRequest:
    id: str                           # unique per request: names the Job and the output folder
    run: str                          # the run's URI (<checkpoints.uri>/<namespace>/<job>/v<N>)
    step: str                         # a checkpoint's step (digits), "final", or "base" (the base model alone)
    compare: bool = False             # base and trained side by side
    prompts: tuple[str, ...] = ()
    steps: int | None = None          # denoising steps
    guidance: float | None = None
    seed: int | None = None
    count: int | None = None
    out: str = field(default="")      # where the images go; default: out_uri(run, label)

    def __post_init__(self):
        if not ID_PATTERN.fullmatch(self.id):
            raise BadGenerationRequest(f"id {self.id!r}: use 1-12 lowercase letters and digits")
        if self.step not in ("final", "base") and not self.step.isdigit():
            raise BadGenerationRequest(f"step {self.step!r}: use a step number, final or base")
        if self.step == "base" and self.compare:
            raise BadGenerationRequest("step base with compare: compare draws the base already")
        if not self.out:
            object.__setattr__(self, "out", out_uri(self.run, self.label))

    @property
    def label(self) -> str:
        """The output folder's name: what was drawn, and the id that keeps two requests apart."""
        step = f"step-{self.step}" if self.step.isdigit() else self.step
        return f"{step}{'-compare' if self.compare else ''}-{self.id}"

    def to_annotation(self) -> str:
        return json.dumps({key: list(value) if isinstance(value, tuple) else value
                           for key, value in asdict(self).items() if value not in (None, (), False)},
                          sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str) -> "GenerationRequest":
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            raw["prompts"] = tuple(str(p) for p in raw.get("prompts", ()))
            return cls(**raw)
        except BadGenerationRequest:
            raise
        except (ValueError, TypeError) as err:
            raise BadGenerationRequest(f"not a generation request ({err})") from None

    def args(self) -> list[str]:
        """The pod's arguments (kubetune_trainer.results.generation_pod reads them)."""
        args = ["--run", self.run, "--step", self.step, "--out", self.out]
        if self.compare:
            args.append("--compare")
        for prompt in self.prompts:
            args += ["--prompt", prompt]
        for name, value in (("--steps", self.steps), ("--guidance", self.guidance), ("--seed", self.seed),
                            ("--count", self.count)):
            if value is not None:
                args += [name, str(value)]
        return args

    def belongs_to(self, job_root: str) -> str | None:
        """Why the request reaches outside the job's own runs (None when it does not): the pod writes
        with the job's credentials, so it draws from and writes beside this job's runs only."""
        root = job_root.rstrip("/") + "/"
        if not self.run.startswith(root) or ".." in self.run.split("/"):
            return f"run {self.run} is not a run of this job (under {root})"
        if not self.out.startswith(self.run.rstrip("/") + "/") or ".." in self.out.split("/"):
            return f"out {self.out} is not beside the run {self.run}"
        return None


def out_uri(run: str, label: str) -> str:
    return layout.join(run, GENERATED_FOLDER, label)
