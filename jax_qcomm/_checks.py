"""Argument checks shared by the public functions (clear ValueErrors naming the parameter)."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(name: str, value: Any, minimum: int = 1) -> int:
  """`value` as an int >= minimum (bools rejected), else ValueError naming `name`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if minimum == 0:
      kind = "a non-negative integer"
    raise ValueError(f"{name} must be {kind}, got {value!r}")
  return int(value)
