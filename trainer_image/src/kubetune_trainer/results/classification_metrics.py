"""How well a classifier's predictions match the labels: accuracy, and precision, recall and F1 per
class and macro-averaged. The one definition the held-out validation (spec.validation.monitor) and
`kubetune evaluate` (metrics.json) both report.

Per class c: precision = TP / predicted c, recall = TP / actually c, F1 = 2 TP / (predicted + actual)
(= 2PR / (P + R)); a ratio with nothing to divide by is 0 (scikit-learn's zero_division=0). The macro
figures are the means over the classes that occur among the labels or the predictions: a class the
evaluated set neither holds nor predicts says nothing of the model and is left out.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """counts[actual, predicted]."""
    pairs = labels.long() * num_classes + predictions.long()
    return torch.bincount(pairs, minlength=num_classes * num_classes).view(num_classes, num_classes)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def per_class(counts: torch.Tensor) -> list[dict[str, float]]:
    """precision, recall, f1 and support (how many of the class there are) of each class."""
    scores = []
    for c in range(counts.shape[0]):
        true_pos, predicted, actual = counts[c, c].item(), counts[:, c].sum().item(), counts[c].sum().item()
        scores.append({"precision": _ratio(true_pos, predicted), "recall": _ratio(true_pos, actual),
                       "f1": _ratio(2 * true_pos, predicted + actual), "support": actual})
    return scores


def summary(counts: torch.Tensor) -> dict[str, float]:
    """accuracy and the macro precision, recall and F1 of a confusion matrix."""
    occurring = [c for c in range(counts.shape[0]) if counts[c].sum() + counts[:, c].sum()]
    classes = per_class(counts)
    macro = {name: sum(classes[c][name] for c in occurring) / len(occurring) if occurring else 0.0
             for name in ("precision", "recall", "f1")}
    return {"accuracy": _ratio(counts.diagonal().sum().item(), counts.sum().item()), **macro}


def classification_metrics(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, float]:
    """accuracy, precision, recall, f1 (macro) of the predictions (what validation logs and monitors)."""
    return summary(confusion_matrix(predictions, labels, num_classes))


def report(predictions: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict:
    """metrics.json: the summary, every class's figures by name, and the confusion matrix."""
    counts = confusion_matrix(predictions, labels, len(classes))
    return {**summary(counts), "samples": int(counts.sum()),
            "per_class": dict(zip(classes, per_class(counts))),
            "confusion_matrix": {"classes": list(classes), "counts": counts.tolist(),
                                 "rows": "actual", "columns": "predicted"}}
