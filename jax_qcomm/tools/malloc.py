"""glibc's malloc set so that XLA:CPU reuses the pages of its large buffers.

XLA:CPU allocates every output buffer afresh on each call. Under glibc's defaults a buffer above
the mmap threshold (128 KiB, rising to at most 32 MiB) is a fresh ``mmap``: each step then
page-faults on every page of its gradients and collective buffers (a 25.6M-value float32 tree is
25,000 faults of 4 KiB per buffer per step), and buffers allocated by threads other than the main
one come from secondary arenas whose heaps hold at most 64 MiB, so they are fresh mmaps whatever
the threshold. :func:`reuse_pages` sets, through ``mallopt``:

* ``M_ARENA_MAX`` = 1: every thread allocates from the main heap;
* ``M_MMAP_THRESHOLD`` = 2 GiB - 1: buffers below it come from the heap (and return to it);
* ``M_TRIM_THRESHOLD`` = 2 GiB - 1: freed memory stays in the heap for the next step.

The same as ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=... MALLOC_TRIM_THRESHOLD_=...`` in the
environment, but applied by the process itself, whoever started it (``srun``, ``mpirun``, a
Kubernetes job). A parameter whose ``MALLOC_*`` variable is set in the environment is left as the
environment set it. Elsewhere than glibc (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: parameter -> (mallopt's constant, value, the environment variable that sets it instead).
REUSE = {
    "M_ARENA_MAX": (-8, 1, "MALLOC_ARENA_MAX"),
    "M_MMAP_THRESHOLD": (-3, 2**31 - 1, "MALLOC_MMAP_THRESHOLD_"),
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1, "MALLOC_TRIM_THRESHOLD_"),
}
MODES = ("reuse", "glibc")
#: What :func:`reuse_pages` did in this process (empty until it runs).
applied: dict[str, str] = {}


def reuse_pages() -> dict[str, str]:
  """Applies :data:`REUSE` with ``mallopt``; returns, per parameter, ``"set"``, ``"env"`` (left
  to the environment's ``MALLOC_*`` variable) or ``"refused"`` (mallopt returned 0). Empty where
  the C library is not glibc."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return {}
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  done = {}
  for name, (param, value, env) in REUSE.items():
    if env in os.environ:
      done[name] = "env"
    else:
      done[name] = "set" if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) else "refused"
  applied.update(done)
  return done
