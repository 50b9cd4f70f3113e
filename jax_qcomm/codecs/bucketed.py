"""The mixins of the bucketed quantisers.

* :class:`_Bucketed` -- buffers padded to whole buckets, a key exactly when rounding is stochastic,
  and the choice between a compiled kernel and the pure-JAX reference (QSGD, Summable, Wire16,
  Auto).
* :class:`_SummedFields` -- the reduction of codecs whose payloads XLA's own all-reduce sums: one
  ``pmax`` of per-bucket statistics and one ``psum`` of uint32 words (Summable, Wire16).
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.transport import _exchange
from jax_qcomm.native import _selftest, wire
from jax_qcomm.transport.axes import axis_size, device_key
from jax_qcomm.codecs.base import (IMPLS, Codec, _check_traffic, _pad_to, _ring, bounded_mark,
                                   concat_leaves, nonfinite_mark, seed_words,
                                   split_leaves)


class _Bucketed(Codec):
  """What the bucketed quantisers (QSGD, Summable, Wire16) share: buffers padded to whole buckets,
  a key needed exactly when rounding is stochastic, and the choice between a compiled kernel and
  the pure-JAX reference. Subclasses have ``bucket_size`` and ``rounding``; those with kernels
  also ``bits`` and ``impl``."""

  def _kernel_platforms(self) -> tuple[str, ...]:
    """The lowering platforms ("cpu", "cuda") with a compiled kernel of this codec."""
    raise NotImplementedError

  def _select(self, ffi_fn, jax_fn, *args, only: tuple[str, ...] | None = None):
    """Runs ffi_fn on platforms with a compiled kernel, jax_fn elsewhere (chosen per lowering by
    ``lax.platform_dependent``); impl="auto" uses a platform's kernels once they passed their
    known-answer test there (:mod:`jax_qcomm.native._selftest`); impl="jax": always jax_fn;
    impl="ffi": the kernels, untested, with no fallback. ``only``: the platforms of a kernel that
    exists on fewer of them than the codec's others (one on the leaves in place, CPU only);
    elsewhere jax_fn, which composes the codec's other kernels there."""
    platforms = self._kernel_platforms()
    if self.impl == "auto":  # only kernels that passed their known-answer test on this platform
      platforms = tuple(p for p in platforms if _selftest.trusted(p))
    if self.impl == "jax" or not platforms:
      return jax_fn(*args)
    if only is not None:
      platforms = tuple(p for p in platforms if p in only)
      if not platforms:
        return jax_fn(*args)
      return lax.platform_dependent(*args, default=jax_fn, **{p: ffi_fn for p in platforms})
    branches = {p: ffi_fn for p in platforms}
    if self.impl == "ffi":
      backend = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
      if backend not in platforms:
        raise ValueError(
            f"{type(self).__name__}(impl='ffi') has compiled kernels for {list(platforms)} only, "
            f"and the default backend is {backend!r}: use impl='auto' (the kernels where they "
            f"exist, the pure-JAX reference elsewhere) or impl='jax'")
      return lax.platform_dependent(*args, **branches)
    return lax.platform_dependent(*args, default=jax_fn, **branches)

  def _seed(self, key: jax.Array | None) -> jax.Array:
    """The kernels' uint32[2] rounding seed; a key is required for stochastic rounding."""
    if key is not None:
      return seed_words(key)
    if self.rounding == "stochastic":
      raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
    return jnp.zeros((2,), jnp.uint32)

  @property
  def needs_key(self) -> bool:
    return self.rounding == "stochastic"

  @property
  def pad_multiple(self) -> int:
    return self.bucket_size

  def _check_bucket_size(self) -> None:
    if (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, np.integer))
        or self.bucket_size <= 0 or self.bucket_size % 8):
      raise ValueError(f"bucket_size must be a positive multiple of 8, got {self.bucket_size!r}")

  def _check_rounding_and_impl(self, kernels: str) -> None:
    """The last checks of ``__post_init__``; then ``bits`` and ``bucket_size`` become plain ints."""
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    if self.impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
    if self.impl == "ffi" and not self._kernel_platforms():
      raise ValueError(f"impl='ffi' but no compiled {kernels} were found (build the package)")
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))
class _SummedFields(_Bucketed):
  """What the codecs whose payloads XLA's own all-reduce sums share (Summable, Wire16): one
  ``lax.pmax`` of a per-bucket statistic (the scales every device quantises with), one ``lax.psum``
  (or ``psum_scatter``) of uint32 words whose fields have room for the sum of D payloads, one
  decode of the sum. A subclass states its fields through four hooks: ``_field_size(n)`` (the
  length x is padded to), ``_stat(x)`` (float32[_field_size(n)] -> per-bucket statistic),
  ``_fields(x, shared, key, devices)`` (-> uint32 words), ``_unfields(words, shared, devices,
  count, n, scale)`` (the sum of ``count`` devices' words -> float32[n] times ``scale``), and
  ``_words(n, devices)`` (words of n values); ``_stat_bytes`` is the size of one statistic;
  ``_stat_max(shared)`` is the largest ``|x|`` the shared statistics stand for (a float32 scalar,
  NaN or infinite where a bucket is not finite), which bounds the result for the finite guard."""

  _stat_bytes = 4

  def _summed(self, stat, fields, unfields, axis_name, key, op):
    """The reduction, once: one pmax of ``stat()``, ``fields(shared, key, D)`` words, one psum,
    ``unfields(words, shared, D, count, scale)`` of the sum (the result) and of this device's own
    words (what it contributed, for the residual); and the result's :func:`bounded_mark` from
    the shared statistics (no pass over the result unless they are not finite)."""
    d = self.check_devices(axis_size(axis_name))
    shared = lax.pmax(stat(), axis_name)  # the same on every device
    words = fields(shared, device_key(key, axis_name, 0), d)
    total = lax.psum(words, axis_name)
    scale = 1.0 / d if op == "mean" else 1.0
    out = unfields(total, shared, d, d, scale)
    # |result| <= D * scale * the largest shared |x| (times 1 + 2**-7 for the rounding of the
    # step): twice that is a bound.
    bound = self._stat_max(shared) * jnp.float32(2.0 * d * scale)
    mark = bounded_mark(bound, lambda: nonfinite_mark(unfields(total, shared, d, d, scale)))
    return out, unfields(words, shared, d, 1, 1.0), mark

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    """One pmax of the statistics, one psum of the words, one decode; the residual is x minus
    this device's own decode."""
    n = x.shape[0]
    xp = _pad_to(x, self._field_size(n))
    out, own, _ = self._summed(
        lambda: self._stat(xp), lambda sh, k, d: self._fields(xp, sh, k, d),
        lambda w, sh, d, c, scale: self._unfields(w, sh, d, c, n, scale), axis_name, key, op)
    return out, x - own

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    outs, lost, _ = self.allreduce_leaves_marked(parts, axis_name, key, op, exchange)
    return outs, lost

  def allreduce_leaves_marked(self, parts, axis_name, key, op="mean", exchange="auto"):
    """:meth:`allreduce_flat` of the leaves' packed buffer, through the ``_*_leaves`` hooks (which
    a codec may implement on the leaves in place); the mark from the shared statistics."""
    sizes = [p.shape[0] for p in parts]
    outs, own, mark = self._summed(
        lambda: self._stat_leaves(parts), lambda sh, k, d: self._fields_leaves(parts, sh, k, d),
        lambda w, sh, d, c, scale: self._unfields_leaves(w, sh, d, c, sizes, scale),
        axis_name, key, op)
    return outs, [p - o for p, o in zip(parts, own)], mark

  # The hooks on leaves: by default the packed buffer's (concat_leaves) through the flat hooks.
  def _packed(self, parts):
    flat = concat_leaves(parts, self)
    return _pad_to(flat, self._field_size(flat.shape[0]))

  def _stat_leaves(self, parts):
    return self._stat(self._packed(parts))

  def _fields_leaves(self, parts, shared, key, devices):
    return self._fields(self._packed(parts), shared, key, devices)

  def _unfields_leaves(self, words, shared, devices, count, sizes, scale=1.0):
    n = wire.leaves_span(sizes, self.pad_multiple)
    flat = self._unfields(words, shared, devices, count, n, scale)
    return split_leaves(flat, sizes, self.pad_multiple)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    """Block i's words summed onto device i: one psum_scatter of [D, W] words (whole rows), the
    statistics of every block shared by one pmax."""
    d = self.check_devices(axis_size(axis_name))
    rows = x.reshape(d, -1)
    m = rows.shape[1]
    rows_p = jax.vmap(lambda r: _pad_to(r, self._field_size(m)))(rows)
    shared = lax.pmax(jax.vmap(self._stat)(rows_p), axis_name)
    row_key = device_key(key, axis_name, 0)
    keys = None if row_key is None else jax.random.split(row_key, d)
    words = jax.vmap(lambda r, sh, k: self._fields(r, sh, k, d),
                     in_axes=(0, 0, None if keys is None else 0))(rows_p, shared, keys)
    mine = _exchange.scatter_sum(words.reshape(-1), axis_name)
    own = lax.dynamic_index_in_dim(shared, lax.axis_index(axis_name), keepdims=False)
    block = self._unfields(mine, own, d, d, m, 1.0 / d if op == "mean" else 1.0)
    mine_decoded = jax.vmap(lambda w, sh: self._unfields(w, sh, d, 1, m))(words, shared)
    return block, (rows - mine_decoded).reshape(-1)

  def traffic(self, n, devices, collective="allreduce"):
    """allreduce: ring all-reduces of the uint32 words (fields for D summed payloads) and of one
    statistic per bucket (the pmax, ``_stat_bytes`` each); reduce_scatter: a reduce-scatter of D
    blocks' words and the pmax of every block's statistics; all_gather: the standalone payloads."""
    n, d, collective = _check_traffic(n, devices, collective)
    if collective == "all_gather":
      return super().traffic(n, d, collective)
    d = self.check_devices(d)
    stat = self._stat_bytes
    if collective == "allreduce":
      return (("all-reduce", _ring(d, 4 * self._words(n, d))),
              ("all-reduce", _ring(d, stat * wire.num_buckets(n, self.bucket_size))))
    m = -(-n // d)
    return (("reduce-scatter", (d - 1) * 4 * self._words(m, d)),
            ("all-reduce", _ring(d, stat * d * wire.num_buckets(m, self.bucket_size))))
