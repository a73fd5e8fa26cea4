"""Errors that mean "the spec asks for something that cannot be done here", not a trainer bug.

The entry point prints them as one line naming the field and exits 2 (InputsInFlux: retryably);
anything else keeps its traceback.
"""


class ConfigError(ValueError):
    """The spec asks for something this machine, this data or this trainer version cannot do."""


class InputsInFlux(RuntimeError):
    """An input changed under the run (a model re-uploaded while the pods fetched it): not the
    spec's fault, and a restart fetches it whole, so the entry point exits with
    RETRYABLE_EXIT_CODE and the job's restart policy brings the pods back."""


class TrainingDiverged(RuntimeError):
    """The loss stopped being a number. The weights are lost from this step on, and a retry from
    the last checkpoint would diverge again at the same step (every draw is seeded per sample),
    so the entry point exits with DIVERGED_EXIT_CODE, which restart policies treat as final."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"training diverged: step {step} gave a loss of {loss}; the checkpoints before it are "
                         "intact and nothing after it was saved. Lower spec.training.learningRate, keep "
                         "spec.training.maxGradNorm above 0, or use mixedPrecision bf16 rather than fp16")
        self.step = step
