"""Wall-clock timing of jitted calls, one implementation for the example trainer's sync-overhead
measurement (``training/train.py``) and the benchmarks (``benchmarks/_common.py`` re-exports it).

* :func:`median_time` -- warm up a function, then time ``repeats`` calls (each one waited for with
  ``jax.block_until_ready``, the garbage collector paused) and keep every time and the minor page
  faults during each: a :class:`Timing`.
* :func:`gc_paused` -- the garbage collector collected once, then off, for a timed region.

Here rather than in ``benchmarks/``: the benchmarks may import the example trainer, the trainer
never imports the benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Iterator

import jax


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
  """Collects garbage once, then keeps the collector off until the block ends (a collection in
  the middle of a timed call would be timed with it)."""
  gc_was_enabled = gc.isenabled()
  gc.collect()
  gc.disable()
  try:
    yield
  finally:
    if gc_was_enabled:
      gc.enable()


def _minor_faults() -> int:
  """Minor page faults of this process so far (0 where getrusage is unavailable)."""
  try:
    import resource  # noqa: PLC0415  (Unix only: elsewhere the count is 0)
  except ImportError:  # pragma: no cover - not Unix
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall-clock seconds of the timed calls of one function, and the minor page faults (of the
  whole process) during each: a nonzero count shows memory being freshly mapped per call."""

  times: tuple[float, ...]
  faults: tuple[int, ...] = ()

  @property
  def median(self) -> float:
    return statistics.median(self.times)

  @property
  def min(self) -> float:
    return min(self.times)

  @property
  def max(self) -> float:
    return max(self.times)

  @property
  def median_faults(self) -> float | None:
    return statistics.median(self.faults) if self.faults else None

  def as_dict(self) -> dict[str, Any]:
    """median_s, min_s, max_s, the individual times_s and page faults, for a JSON row."""
    return dict(median_s=self.median, min_s=self.min, max_s=self.max, times_s=list(self.times),
                minor_faults_median=self.median_faults, minor_faults=list(self.faults))


def median_time(fn: Callable[..., Any], *args: Any, repeats: int = 7, warmup: int = 2) -> Timing:
  """Times ``fn(*args)`` ``repeats`` times after ``warmup`` untimed calls (compilation included).

  Each call is waited for with ``jax.block_until_ready`` and its result dropped before the next
  call starts. The garbage collector is paused while timing. Returns the times and the minor
  page faults during each timed call.
  """
  if repeats < 1 or warmup < 1:
    raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times, faults = [], []
  with gc_paused():
    for _ in range(repeats):
      faults0 = _minor_faults()
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
      faults.append(_minor_faults() - faults0)
  return Timing(tuple(times), tuple(faults))
