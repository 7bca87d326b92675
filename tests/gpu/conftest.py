"""The GPU kernel checks run the CPU kernel tests' cases (``tests/kernels/test_kernels_*.py``)
on a CUDA device, so those modules are importable from here by name."""

from __future__ import annotations

import sys
from pathlib import Path

_KERNEL_TESTS = str(Path(__file__).resolve().parents[1] / "kernels")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)
