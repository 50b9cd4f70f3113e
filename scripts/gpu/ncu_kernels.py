"""One call of each QSGD kernel at 256M float32, for Nsight Compute (``ncu``); needs a GPU.

XLA's ``x + 1`` of the same array runs first (the copy bandwidth), then, for each scheme (4 bits,
bucket 128, stochastic rounding): encode, decode-sum of 4 payloads, fused decode-sum-reencode.
docs/cuda.md gives the ``ncu`` command and the results.
"""

import jax
import jax.numpy as jnp

from jax_qcomm import QSGD

N = 256_000_000


def main() -> None:
  x = jax.random.normal(jax.random.key(1), (N,), jnp.float32)
  jax.block_until_ready(jax.jit(lambda a: a + jnp.float32(1))(x))
  for scheme in ("maxmin", "norm"):
    c = QSGD(4, 128, scheme, impl="ffi")
    p = jax.jit(c.encode)(x, jax.random.key(0))
    ps = jnp.stack([p, p, p, p])
    jax.block_until_ready(jax.jit(lambda q, c=c: c.decode_sum(q, (N,)))(ps))
    jax.block_until_ready(jax.jit(lambda q, k, c=c: c.decode_sum_reencode(q, (N,), k, 0.25))(
        ps, jax.random.key(1)))
  print("done")


if __name__ == "__main__":
  main()
