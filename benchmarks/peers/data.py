"""Payload data, reference mean, relative error and wire-byte accounting shared by both sides of
the peers benchmark: the JAX allreduce benchmark (Python 3.12+, jax) and the PyTorch worker
(Python 3.11, torch). numpy only, so that both interpreters can import it.

A *spec* (a JSON file written by :mod:`benchmarks.peers.run`) names a payload and lists its leaves
in a fixed order, ``{"payload": ..., "leaves": [{"name": ..., "shape": [...]}, ...],
"gradients": null | "file.npz"}``. Rank r's value of leaf i is

* with ``gradients``: the array ``rank{r}/{name}`` of that npz (a real gradient, written by
  :mod:`benchmarks.peers.make_gradients`);
* without: standard normal float32 from ``numpy.random.default_rng([SEED, r, i])``;

so every framework reduces bit-identical inputs, and the exact mean is known to every process.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

SEED = 7
#: The torch worker's methods (:mod:`benchmarks.peers.torch_worker`); ``ddp_powersgd<r>`` for any
#: rank r.
TORCH_METHODS = ("allreduce_fp32", "ddp_fp32", "ddp_fp16", "ddp_bf16", "ddp_powersgd1",
                 "ddp_powersgd4")
#: torch's PowerSGD default: a matrix is compressed only if (n + m) r * 2 < n m.
POWERSGD_MIN_COMPRESSION_RATE = 2


# -- specs and inputs --------------------------------------------------------------------------------

def make_spec(payload: str, leaves: Sequence[tuple[str, Sequence[int]]],
              gradients: str | None = None) -> dict[str, Any]:
  """The spec of a payload: its leaves (name, shape) in order, and the optional gradient file."""
  return dict(payload=payload, leaves=[dict(name=n, shape=[int(s) for s in shape])
                                       for n, shape in leaves],
              gradients=None if gradients is None else os.path.abspath(gradients))


def write_spec(path: str, spec: dict[str, Any]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(spec, f, indent=1)


def read_spec(path: str) -> dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    spec = json.load(f)
  for key in ("payload", "leaves"):
    if key not in spec:
      raise ValueError(f"spec {path} has no {key!r}")
  return spec


def shapes(spec: dict[str, Any]) -> list[tuple[int, ...]]:
  return [tuple(leaf["shape"]) for leaf in spec["leaves"]]


def num_elements(spec: dict[str, Any]) -> int:
  return sum(math.prod(s) for s in shapes(spec))


def npz_key(rank: int, name: str) -> str:
  """Name of rank ``rank``'s leaf ``name`` in a gradients npz."""
  return f"rank{rank}/{name}"


@functools.lru_cache(maxsize=4)
def _npz(path: str):
  return np.load(path)


def gradient_ranks(path: str) -> int:
  """How many ranks a gradients npz holds (rank0..rank{k-1})."""
  ranks = {key.split("/", 1)[0] for key in _npz(path).files}
  k = 0
  while f"rank{k}" in ranks:
    k += 1
  return k


def leaf_array(spec: dict[str, Any], rank: int, index: int) -> np.ndarray:
  """Rank ``rank``'s float32 value of leaf ``index`` (see the module docstring)."""
  leaf = spec["leaves"][index]
  shape = tuple(leaf["shape"])
  if spec.get("gradients"):
    a = np.asarray(_npz(spec["gradients"])[npz_key(rank, leaf["name"])], np.float32)
    if a.shape != shape:
      raise ValueError(f"{spec['gradients']}: {npz_key(rank, leaf['name'])} has shape {a.shape}, "
                       f"the spec says {shape}")
    return a
  return np.random.default_rng([SEED, rank, index]).standard_normal(shape, dtype=np.float32)


def exact_mean(spec: dict[str, Any], index: int, nranks: int) -> np.ndarray:
  """The exact (float64) mean over ``nranks`` ranks of leaf ``index``."""
  acc = np.zeros(tuple(spec["leaves"][index]["shape"]), np.float64)
  for r in range(nranks):
    acc += leaf_array(spec, r, index)
  return acc / nranks


def relative_error(outputs: Iterable[np.ndarray], spec: dict[str, Any], nranks: int) -> float:
  """||out - exact_mean|| / ||exact_mean|| over the whole payload (all leaves, Frobenius norm).

  ``outputs`` are the reduced leaves in spec order (any layout whose size matches: they are
  flattened). The mean is rebuilt leaf by leaf, so memory stays at one leaf in float64.
  """
  err2 = ref2 = 0.0
  count = 0
  for i, out in enumerate(outputs):
    ref = exact_mean(spec, i, nranks).reshape(-1)
    diff = np.asarray(out, np.float64).reshape(-1) - ref
    err2 += float(diff @ diff)
    ref2 += float(ref @ ref)
    count += 1
  if count != len(spec["leaves"]):
    raise ValueError(f"got {count} outputs for {len(spec['leaves'])} leaves")
  return math.sqrt(err2 / ref2) if ref2 > 0 else float("nan")


# -- wire bytes ------------------------------------------------------------------------------------------

def ring_sent(payload_bytes: int, devices: int) -> int:
  """Bytes each device sends in a ring allreduce of ``payload_bytes``: 2 (D-1)/D x payload."""
  return 0 if devices < 2 else (2 * (devices - 1) * payload_bytes) // devices


def link_floor_s(sent_bytes: int, link_gbps: float | None) -> float | None:
  """The time the bytes a device sends take on its link alone."""
  return None if not link_gbps else sent_bytes * 8 / (link_gbps * 1e9)


def powersgd_elements(leaf_shapes: Sequence[Sequence[int]], rank: int,
                      min_compression_rate: int = POWERSGD_MIN_COMPRESSION_RATE) -> dict[str, int]:
  """Elements PowerSGD allreduces for one bucket holding these leaves (torch's powerSGD_hook).

  Each tensor is viewed as a matrix (shape[0], rest); with r = min(n, m, rank) it is compressed
  iff (n + m) r * min_compression_rate < n m, and then sends P (n x r) and Q (m x r); every
  other tensor (1-D ones included: m = 1 never passes) is allreduced as is. Returns the counts
  of the three float32 allreduces: ``uncompressed``, ``p``, ``q``, and ``matrices`` compressed.
  """
  if rank < 1:
    raise ValueError(f"rank must be >= 1, got {rank}")
  out = dict(uncompressed=0, p=0, q=0, matrices=0)
  for shape in leaf_shapes:
    n = int(shape[0]) if len(shape) else 1
    m = math.prod(shape) // n if n else 0
    r = min(n, m, rank)
    if (n + m) * r * min_compression_rate < n * m:
      out["p"] += n * r
      out["q"] += m * r
      out["matrices"] += 1
    else:
      out["uncompressed"] += n * m
  return out


def powersgd_rank(method: str) -> int | None:
  """r of ``ddp_powersgd<r>``; None for the other methods."""
  prefix = "ddp_powersgd"
  return int(method[len(prefix):]) if method.startswith(prefix) and method[len(prefix):].isdigit() \
      else None


def check_torch_method(method: str) -> str:
  """A torch method name (ValueError otherwise)."""
  if method in TORCH_METHODS or (powersgd_rank(method) or 0) >= 1:
    return method
  raise ValueError(f"unknown torch method {method!r}; choose from {', '.join(TORCH_METHODS)} "
                   "(ddp_powersgd<rank> for any rank >= 1)")


def torch_payload_bytes(method: str, leaf_shapes: Sequence[Sequence[int]]) -> int:
  """Bytes of the buffers a torch method allreduces once (before the ring's 2 (D-1)/D).

  ``allreduce_fp32``/``ddp_fp32``: 4 per element; ``ddp_fp16``/``ddp_bf16``: 2 per element;
  ``ddp_powersgd<r>``: 4 x (uncompressed + P + Q) elements.
  """
  n = sum(math.prod(s) for s in leaf_shapes)
  if method in ("allreduce_fp32", "ddp_fp32"):
    return 4 * n
  if method in ("ddp_fp16", "ddp_bf16"):
    return 2 * n
  check_torch_method(method)
  e = powersgd_elements(leaf_shapes, powersgd_rank(method))
  return 4 * (e["uncompressed"] + e["p"] + e["q"])
