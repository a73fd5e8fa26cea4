"""The kubetune trainer: the code of the trainer image."""
from kubetune_trainer.telemetry import library_noise

library_noise.install()
