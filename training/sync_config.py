"""A trainer config's gradient synchronisation, shared by the example trainers (train.py, lm.py).

Both configs carry the settings under the library's own names: the codec's (``bits``,
``bucket_size``, ``scheme``: :func:`qcomm.codec_for_bits`), the leaf policy's (``min_size``,
``compress_1d``, ``exclude``: :class:`qcomm.LeafPolicy`) and ``qcomm.sync``'s (``accum_steps``,
``error_feedback``, ``seed``; ``comm_bucket_size`` where the config has it). The library checks them:
:func:`check_sync_fields` builds the sync once, before any compute, and hands its ValueError on
with the field named (``config.bits must be ...``), so no trainer repeats the codec's rules.
"""

from __future__ import annotations

import ml_collections
import optax

import jax.numpy as jnp

import jax_qcomm as qcomm


def exclude_patterns(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """``config.exclude`` (comma-separated regexes of parameter paths sent exact) as a tuple."""
  return tuple(p.strip() for p in config.exclude.split(",") if p.strip())


def create_sync(config: ml_collections.ConfigDict, inner: optax.GradientTransformation,
                axis_name) -> optax.GradientTransformation:
  """``qcomm.sync(inner, axis_name=axis_name)`` with every synchronisation setting taken from the
  config (``axis_name``: a mesh axis name, a tuple of them, or ``qcomm.Hierarchical``)."""
  extra = {"comm_bucket_size": config.comm_bucket_size} if "comm_bucket_size" in config else {}
  if config.get("shard_state", False):  # sharded optimizer state, weight differences at gather_bits
    extra.update(shard_state=True, gather_codec=qcomm.QSGD(config.gather_bits, config.bucket_size,
                                                           rounding="nearest"))
  if config.get("shard_params", False):  # sharded parameters, gathered at param_gather_bits
    extra.update(shard_params=True, param_codec=param_codec(config.param_gather_bits,
                                                            config.bucket_size))
  codec = qcomm.codec_for_bits(config.bits, config.bucket_size, config.scheme,
                               rounding="nearest" if config.error_feedback else "stochastic")
  error_feedback = config.error_feedback
  if config.get("powersgd", 0):  # the low-rank codec, with its own default: error feedback on
    codec, error_feedback = qcomm.PowerSGD(config.powersgd), None
  policy = qcomm.LeafPolicy(min_size=config.min_size, compress_1d=config.compress_1d,
                            exclude=exclude_patterns(config))
  return qcomm.sync(inner, axis_name=axis_name, codec=codec, policy=policy,
                    accum_steps=config.accum_steps, error_feedback=error_feedback,
                    seed=config.seed, **extra)


def param_codec(bits: int, bucket_size: int) -> qcomm.Codec:
  """The parameters' gather codec of ``param_gather_bits``: 32 exact, 16 bfloat16, 1..8 QSGD
  rounded to nearest (ZeRO++'s qwZ at 8)."""
  if bits == 32:
    return qcomm.NoCompression()
  if bits == 16:
    return qcomm.Cast(jnp.bfloat16)
  if not (isinstance(bits, int) and 1 <= bits <= 8):
    raise ValueError(f"param_gather_bits must be 32, 16 or 1..8, got {bits!r}")
  return qcomm.QSGD(bits, bucket_size, rounding="nearest")


def check_sync_fields(config: ml_collections.ConfigDict) -> None:
  """The library's ValueError for a bad synchronisation setting, naming the config field (the
  sync's parameters have the fields' names); builds nothing but the (lazy) transformation."""
  try:
    create_sync(config, optax.identity(), "data")
  except ValueError as e:
    field = str(e).split(" ", 1)[0]
    if field in config:
      raise ValueError(f"config.{e}") from e
    raise
