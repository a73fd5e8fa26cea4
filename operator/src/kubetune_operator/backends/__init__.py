"""Child-job backends: how a TrainingJob becomes the workload object of a training system.

PyTorchJob (Kubeflow Training Operator v1) is what runs today; Kubeflow Trainer v2's TrainJob
is one more module implementing `Backend`.
"""
from kubetune_operator.backends.base import Backend, ChildState
from kubetune_operator.backends.pytorchjob import PyTorchJobBackend

__all__ = ["Backend", "ChildState", "PyTorchJobBackend"]
