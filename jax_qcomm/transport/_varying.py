"""Checks that values meant to differ per device really do (shard_map's varying-axes types).

Inside ``jax.shard_map`` (with ``check_vma=True``, the default) JAX records, for every value, the
mesh axes it varies over. A collective that averages per-device values uses that record to catch
the commonest data-parallel mistake: the gradient of a *replicated* parameter is summed across the
axis by autodiff itself, so it arrives already summed (and unvarying), and averaging it once more
gives updates D times too large without any error.

Under ``jax.pmap`` and ``shard_map(check_vma=False)`` JAX keeps no such record; the checks here are
then skipped (:func:`tracked` is False).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import jax
from jax import lax

from jax_qcomm import _compat
from jax_qcomm._checks import path_str


def tracked(names: Sequence[Hashable]) -> bool:
  """True where JAX tracks which values vary over every axis in ``names`` (shard_map with
  check_vma); False under pmap or check_vma=False. The axes must be bound."""
  # axis_index varies over its axis exactly when vma is tracked; XLA drops the unused op.
  return all(n in _compat.vma_of(lax.axis_index(n)) for n in names)


def unvarying(tree: Any, names: Sequence[Hashable]) -> list[tuple[str, tuple]]:
  """(path, missing axes) of the leaves of ``tree`` that do not vary over all of ``names``."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    missing = tuple(n for n in names if n not in _compat.vma_of(leaf))
    if missing:
      out.append((path_str(path) or "<root>", missing))
  return out


def _fmt_axes(axes: Sequence[Hashable]) -> str:
  return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def check_per_device(tree: Any, names: Sequence[Hashable], what: str, caller: str) -> None:
  """ValueError if a leaf of ``tree`` (a per-device input of ``caller``) is the same on every
  device, i.e. not varying over ``names``; nothing where JAX does not track it (pmap)."""
  if not tracked(names):
    return
  bad = unvarying(tree, names)
  if not bad:
    return
  path, missing = bad[0]
  more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
  axis = _fmt_axes(missing)
  raise ValueError(
      f"{caller}: {what} leaf '{path}'{more} is not varying over axis {axis}, so it holds the "
      f"same value on every device. {caller} averages per-device values. If these are gradients, "
      f"autodiff has already summed them across the devices (inside jax.shard_map the gradient of "
      f"a replicated parameter is psum'med by JAX, uncompressed), and averaging them again makes "
      f"the updates as many times too large as there are devices. Fix: differentiate a varying "
      f"copy of the parameters:\n"
      f"    local = jax.tree.map(lambda p: jax.lax.pcast(p, {axis}, to='varying'), params)\n"
      f"    grads = jax.grad(loss_fn)(local, batch)\n"
      f"(qcomm.data_parallel does this for you). If the value is meant to be the same on every "
      f"device, pass check_varying=False.")
