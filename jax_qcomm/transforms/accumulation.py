"""Gradient accumulation inside one step: micro-batches summed with ``lax.scan``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm._checks import check_array_leaves, check_callable, check_int


def accumulate_gradients(grad_fn: Callable[[Any, Any], tuple[jax.Array, Any]], params: Any,
                         batch: Any, accum_steps: int) -> tuple[jax.Array, Any]:
  """Mean loss and mean gradients over ``accum_steps`` micro-batches of ``batch``.

  Args:
    grad_fn: ``(params, micro_batch) -> (loss, grads)``, e.g. ``jax.value_and_grad(loss_fn)``.
      The loss must be a mean over the micro-batch, so that the mean over equal micro-batches is the
      full-batch loss.
    params: passed to grad_fn unchanged.
    batch: a pytree of arrays sharing a leading batch dimension divisible by ``accum_steps``.
    accum_steps: number of micro-batches; memory is that of one micro-batch (``lax.scan``).

  Returns:
    (loss, grads): means over the micro-batches; grads have the dtypes grad_fn returns, summed in
    float32.
  """
  check_callable("grad_fn", grad_fn)
  check_int("accum_steps", accum_steps)
  check_array_leaves("batch", batch)
  leaves = jax.tree_util.tree_leaves(batch)
  if not leaves:
    raise ValueError("batch must contain at least one array")
  sizes = {leaf.shape[0] if jnp.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"batch leaves must share a leading batch dimension, got sizes {sorted(map(str, sizes))}")
  size = sizes.pop()
  if size % accum_steps:
    raise ValueError(f"the batch size {size} must be divisible by accum_steps={accum_steps}")
  if accum_steps == 1:
    return grad_fn(params, batch)

  micro = jax.tree_util.tree_map(
      lambda x: x.reshape((accum_steps, size // accum_steps) + x.shape[1:]), batch)
  loss_shape, grads_shape = jax.eval_shape(grad_fn, params,
                                           jax.tree_util.tree_map(lambda x: x[0], micro))
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), grads_shape)

  def body(carry, mb):
    loss_sum, grad_sum = carry
    loss, grads = grad_fn(params, mb)
    grad_sum = jax.tree_util.tree_map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
    return (loss_sum + loss.astype(jnp.float32), grad_sum), None

  (loss_sum, grad_sum), _ = lax.scan(body, (jnp.zeros(loss_shape.shape, jnp.float32), zeros), micro)
  inv = jnp.float32(1.0 / accum_steps)
  grads = jax.tree_util.tree_map(lambda a, s: (a * inv).astype(s.dtype), grad_sum, grads_shape)
  return (loss_sum * inv).astype(loss_shape.dtype), grads
