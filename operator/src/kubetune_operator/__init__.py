"""The kubetune operator: TrainingJob → trainer ConfigMap + a child training job (PyTorchJob)."""
