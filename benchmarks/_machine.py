"""Machine facts every benchmark records, with the standard library only (the PyTorch peer worker,
which runs in a venv without jax, imports it too)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where there is none)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
          return value.strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()
