"""How a figure is written in logs and reports: rounded, and a dash when there is none."""

from __future__ import annotations

import math
from typing import Any


def fmt(x: Any, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals when it is a float; ``—`` for ``None`` and NaN.

    Milliseconds take 3 decimals (µs resolution), microseconds 1 or 2, ratios 2.
    """
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isnan(x):
            return "—"
        return f"{x:.{digits}f}"
    return str(x)
