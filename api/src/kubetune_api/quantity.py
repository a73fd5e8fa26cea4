"""Kubernetes resource quantities (80Gi, 81920Mi, 85.9G) as bytes."""
from __future__ import annotations

import re
from decimal import Decimal

SUFFIXES = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
# The byte forms of a quantity (a memory size has no milli-units): number, then a suffix.
PATTERN = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(" + "|".join(s for s in SUFFIXES if s) + r")?$")


def parse_quantity(value: str, field: str) -> int:
    """Bytes of a memory quantity; ValueError naming `field` and the accepted forms otherwise."""
    match = PATTERN.match(str(value).strip())
    if not match:
        raise ValueError(f"{field}: {value!r} is not a memory size; write a Kubernetes quantity such as "
                         "80Gi, 81920Mi or 85G")
    number, suffix = match.groups()
    return int(Decimal(number) * SUFFIXES[suffix or ""])


# Any quantity Kubernetes accepts for cpu or memory: a number, then an optional milli or size suffix.
_ANY_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|" + "|".join(s for s in SUFFIXES if s) + r")?$")


def scale_quantity(value: str, factor: int, field: str) -> str:
    """VALUE times FACTOR in VALUE's own unit ("8Gi" x 2 = "16Gi", "500m" x 3 = "1500m"); ValueError
    naming FIELD when VALUE is not a quantity."""
    match = _ANY_QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{field}: {value!r} is not a quantity; write e.g. 2, 500m or 8Gi")
    number, suffix = match.groups()
    scaled = Decimal(number) * factor
    text = format(scaled.normalize(), "f") if scaled != scaled.to_integral() else str(int(scaled))
    return text + (suffix or "")
