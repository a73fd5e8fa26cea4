"""Cross-field rules of the TrainingJob spec, each written once.

A Rule is one object: the CEL expression the API server evaluates (the CRD's
x-kubernetes-validations, at the level of the object it guards), the same test in Python on the
typed object (`kubetune validate`, the admission webhook, the trainer), and the one message both
give. tests/unit/test_rules.py evaluates every CEL expression with a CEL interpreter against the
same objects as the Python test, so the two sides cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationInfo

# Validation context key that builds a typed object without its cross-field rules (for the test
# that compares each rule's two sides on objects that break it).
SKIP_RULES = "skip_cross_field_rules"


@dataclass(frozen=True)
class Rule:
    # True when the object is acceptable; self = the guarded object. None where CEL cannot see the
    # field: one the CRD leaves untyped (a number-or-list), which the API server's CEL compiler
    # refuses to name. Such a rule is the admission webhook's (and kubetune validate's) alone.
    cel: str | None
    holds: Callable[[Any], bool]      # the same test on the typed object
    message: str                      # what the API server and Python both say when it fails
    # What Python adds to the message about the value it refused (the counts nearest a refused
    # spec.data.frames); the API server's CEL message has no such part.
    detail: Callable[[Any], str] | None = None

    def explain(self, obj: Any) -> str:
        return self.message if self.detail is None else f"{self.message}: {self.detail(obj)}"

    def entry(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


def entries(rules: list[Rule]) -> dict:
    """The json_schema_extra that puts RULES into the CRD (those with a CEL form)."""
    return {"x-kubernetes-validations": [rule.entry() for rule in rules if rule.cel is not None]}


def enforce(rules: list[Rule], obj: Any, info: ValidationInfo | None = None) -> Any:
    """OBJ when every rule holds; a ValueError with each broken rule's message otherwise."""
    if info is not None and (info.context or {}).get(SKIP_RULES):
        return obj
    broken = [rule.explain(obj) for rule in rules if not rule.holds(obj)]
    if broken:
        raise ValueError("; ".join(broken))
    return obj
