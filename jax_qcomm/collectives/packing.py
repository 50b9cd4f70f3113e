"""Pytree -> flat communication buffers and back, and the per-leaf compression policy.

A model with 160 leaves must not issue 320 collectives, so leaves that share a codec are concatenated
into flat float32 buffers of at most ``comm_bucket_size`` elements, or the codec's own bound
(:func:`plan`, :meth:`jax_qcomm.Codec.comm_buffer_size`). Each leaf is padded to a whole number of
quantisation buckets first, so a quantisation bucket never straddles two leaves;
``jax_qcomm.codecs.concat_leaves`` builds such a buffer and ``split_leaves`` takes it apart, and a
codec may reduce the leaves in place of the copy (``Codec.allreduce_leaves``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from jax_qcomm import _compat
from jax_qcomm.native import wire
from jax_qcomm._checks import check_bool, check_int, path_str, shown  # noqa: F401 (path_str: re-exported)
from jax_qcomm.codecs import Codec, NoCompression, is_float_dtype


@dataclasses.dataclass(frozen=True)
class LeafPolicy:
  """Decides, per leaf, which codec synchronises it.

  Args:
    min_size: leaves with fewer elements travel exact (their compression saves little and costs a
      lot of accuracy per byte). Default (None): 1024, or 0 for a sparse codec
      (:attr:`Codec.sparse`: its error feedback loses nothing of a small leaf).
    compress_1d: if False, 1-D leaves (biases, norm scales) travel exact. Default (None): False,
      or True for a sparse codec.
    exclude: regular expressions; a leaf whose path ('params/Dense_0/bias') matches any of them
      (``re.search``) travels exact.
    overrides: mapping of path regex -> codec; the first match wins over the default codec (and over
      the size and 1-D rules).
  """

  min_size: int | None = None
  compress_1d: bool | None = None
  exclude: tuple[str, ...] = ()
  overrides: tuple[tuple[str, Codec], ...] = ()

  def __init__(self, min_size: int | None = None, compress_1d: bool | None = None,
               exclude: str | Sequence[str] = (),
               overrides: Mapping[str, Codec] | Sequence[tuple[str, Codec]] = ()):
    if min_size is not None:
      min_size = check_int("min_size", min_size, minimum=0)
    if compress_1d is not None:
      compress_1d = check_bool("compress_1d", compress_1d)
    if isinstance(exclude, str):
      exclude = (exclude,)
    if isinstance(exclude, (bytes, Mapping)) or not hasattr(exclude, "__iter__"):
      raise ValueError(f"exclude must be a regular expression or a sequence of them, "
                       f"got {shown(exclude)}")
    exclude = tuple(exclude)
    for pat in exclude:
      _compile(pat, "exclude")
    if overrides is None:
      overrides = ()
    if isinstance(overrides, Mapping):
      items = tuple(overrides.items())
    elif isinstance(overrides, (str, bytes)) or not hasattr(overrides, "__iter__"):
      items = None
    else:
      items = tuple(overrides)
    if items is None or not all(
        isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
      raise ValueError(f"overrides must be a mapping of regular expression -> codec (or a sequence "
                       f"of (regex, codec) pairs), got {shown(overrides)}")
    items = tuple(tuple(it) for it in items)
    for pat, codec in items:
      _compile(pat, "overrides")
      if not isinstance(codec, Codec):
        raise ValueError(f"overrides[{pat!r}] must be a jax_qcomm codec, got {codec!r}")
    object.__setattr__(self, "min_size", min_size)
    object.__setattr__(self, "compress_1d", compress_1d)
    object.__setattr__(self, "exclude", exclude)
    object.__setattr__(self, "overrides", items)

  def codec_for(self, path: str, leaf: Any, default: Codec) -> Codec:
    for pat, codec in self.overrides:
      if re.search(pat, path):
        return codec
    if any(re.search(p, path) for p in self.exclude):
      return NoCompression()
    min_size = (0 if default.sparse else 1024) if self.min_size is None else self.min_size
    compress_1d = default.sparse if self.compress_1d is None else self.compress_1d
    if leaf.size < min_size or (leaf.ndim <= 1 and not compress_1d):
      return NoCompression()
    return default


def fragment_groups(sizes: Sequence[int], fragments: int) -> list[list[int]]:
  """The leaves (indices in the tree's order) of each of ``fragments`` fragments: consecutive
  leaves, cut where the running size first reaches each multiple of total / fragments, none
  empty. ValueError with fewer leaves than fragments."""
  if len(sizes) < fragments:
    raise ValueError(f"fragments must be at most the number of parameter leaves, got "
                     f"fragments={fragments} for {len(sizes)} leaves")
  total, groups, run = sum(int(n) for n in sizes), [[]], 0
  for i, n in enumerate(sizes):
    left = len(sizes) - i  # leaves not yet placed, this one included
    if groups[-1] and (left <= fragments - len(groups)
                       or run >= len(groups) * total / fragments) and len(groups) < fragments:
      groups.append([])
    groups[-1].append(i)
    run += int(n)
  return groups


@dataclasses.dataclass(frozen=True)
class _Shape:
  """What LeafPolicy.codec_for reads of a leaf (size and ndim), for arrays and shape structs."""

  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)


def leaf_codecs(tree: Any, codec: Codec, policy: LeafPolicy | None = None) -> list[Codec]:
  """The codec of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` s), in tree order: a
  bare array gets ``codec``; the leaves of a pytree get what ``policy`` (default ``LeafPolicy()``)
  picks for them. The one decision that the allreduce and :func:`jax_qcomm.transforms.describe` share."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if treedef.num_leaves == 1 and treedef.num_nodes == 1:
    return [codec]
  policy = LeafPolicy() if policy is None else policy
  return [policy.codec_for(path_str(p), _Shape(tuple(int(d) for d in jnp.shape(leaf))), codec)
          for p, leaf in with_path]


def _compile(pattern: str, name: str) -> None:
  if not isinstance(pattern, str):
    raise ValueError(f"{name} entries must be regular expressions (strings), got {pattern!r}")
  try:
    re.compile(pattern)
  except (re.error, TypeError) as e:
    raise ValueError(f"{name} entries must be regular expressions, got {pattern!r}: {e}") from None


def check_float_leaves(tree: Any, name: str = "x") -> None:
  """ValueError naming the first leaf that is not a float32/bfloat16/float16 array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jnp.result_type(leaf)
    if not is_float_dtype(dtype):
      where = path_str(path) or "<root>"
      raise ValueError(f"{name} leaf '{where}' must be float32, bfloat16 or float16, got {dtype}")


def padded_size(n: int, codec: Codec) -> int:
  """Elements a leaf of ``n`` takes in a flat buffer: n rounded up to whole buckets."""
  return wire.leaves_span([n], codec.pad_multiple)


def vma_kind(leaf: Any) -> frozenset:
  """The manual axes a traced leaf varies over (empty for concrete and abstract shapes)."""
  return _compat.vma_of(leaf) if isinstance(leaf, jax.core.Tracer) else frozenset()


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves (by index in the flattened tree) that travel together in one flat buffer."""
  codec: Codec
  leaves: tuple[int, ...]


def plan(leaves: Sequence[Any], codecs: Sequence[Codec], comm_bucket_size: int | None,
         devices: int, collective: str = "allreduce",
         kinds: Sequence[Any] | None = None) -> list[Group]:
  """Groups consecutive-by-codec leaves into buffers of at most ``comm_bucket_size`` elements
  (None: each codec's own :meth:`~jax_qcomm.Codec.comm_buffer_size` for ``collective`` over
  ``devices``).

  A leaf larger than the bound gets a buffer of its own. Order within a group follows the tree
  order, so the plan is deterministic (every device builds the same buffers). Inside nested
  ``shard_map`` s, leaves that vary over different manual axes travel apart (a model-sharded
  leaf's shard and a leaf replicated over the model axes): a replicated leaf's result then stays
  replicated, by construction and in jax's type. ``kinds`` (one per leaf) says which leaves
  vary alike where they are not traced (``describe`` of model-sharded parameters).
  """
  by_kind: dict[tuple, list[list[int]]] = {}
  sizes: dict[tuple, int] = {}
  bounds: dict[Codec, int] = {}
  for i, (leaf, codec) in enumerate(zip(leaves, codecs)):
    padded = padded_size(leaf.size, codec)
    if codec not in bounds:
      bounds[codec] = comm_bucket_size if comm_bucket_size is not None else check_int(
          f"{type(codec).__name__}.comm_buffer_size", codec.comm_buffer_size(devices, collective))
    kind = (codec, vma_kind(leaf) if kinds is None else kinds[i])
    groups = by_kind.setdefault(kind, [[]])
    if groups[-1] and sizes[kind] + padded > bounds[codec]:
      groups.append([])
      sizes[kind] = 0
    groups[-1].append(i)
    sizes[kind] = sizes.get(kind, 0) + padded
  return [Group(kind[0], tuple(g)) for kind, gs in by_kind.items() for g in gs if g]
