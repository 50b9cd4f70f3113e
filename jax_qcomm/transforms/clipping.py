"""``qcomm.clip_by_global_norm``: ``optax.clip_by_global_norm`` that is right inside a sharded sync.

Inside ``qcomm.sync(inner, shard_state=True)``, ``inner`` sees this device's shard of every
gradient, so ``optax.clip_by_global_norm`` would clip by the norm of the shard, differently on
every device. This transformation completes the sum of squares over all shards with one scalar
``psum``; anywhere else it is ``optax.clip_by_global_norm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jax_qcomm._checks import check_real
from jax_qcomm.collectives.shard_layout import global_sum_of_squares


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """Scales the updates so that their global L2 norm is at most ``max_norm`` (optax's
  semantics: unchanged below it, times ``max_norm / norm`` above), with the norm over the whole
  model also when ``inner`` of a sharded :func:`qcomm.sync` sees shards."""
  max_norm = check_real("max_norm", max_norm)
  if not max_norm > 0:
    raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")

  def update(updates, state, params=None):
    del params
    norm = jnp.sqrt(global_sum_of_squares(updates))
    trigger = norm < max_norm  # as optax.clip_by_global_norm computes it
    return jax.tree_util.tree_map(
        lambda t: jnp.where(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
