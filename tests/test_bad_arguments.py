"""Every public parameter rejects bad arguments with an error that names it (issue 16, item 3).

One table, :data:`CASES`: for each public callable (everything in ``jax_qcomm.__all__``, the
array API and sizes of every codec class in it, and the ``init`` / ``update`` that ``sync``
returns) and each of its parameters, at least one bad argument, the exception it must raise, and the
parameter's name, which the message must contain. :func:`test_every_public_parameter_has_a_case`
reads the signatures with ``inspect`` and fails, listing them, for parameters without a case: a new
public parameter needs a check and a line here.

The library's convention is ValueError for bad values and wrong types alike (see
``jax_qcomm/_checks.py``); the one TypeError is ``update``'s ``state`` that is not a SyncState.
Everything here runs at trace time: the collectives are traced (``jax.eval_shape``) inside a
``shard_map`` over 2 of the host devices that tests/conftest.py sets up, nothing is compiled.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

AX = "d"

#: The public methods of every codec class in __all__ (the array API and the sizes).
CODEC_METHODS = ("encode", "decode", "decode_sum", "decode_sum_reencode", "roundtrip",
                 "payload_size", "wire_size", "wire_bits", "traffic", "sent_bytes", "resolve")

#: Parameters that cannot be bad, each with the reason. Keep it short.
EXEMPT = {
    # A pytree container: JAX rebuilds it with arbitrary leaves (PartitionSpecs, tracers, None,
    # ShapeDtypeStructs), so its fields cannot be checked when it is made; sync's update checks
    # the state it receives (see the ("sync().update", "state") case).
    **{("SyncState", f): "pytree container" for f in qcomm.SyncState._fields},
    **{("ShardedSyncState", f): "pytree container" for f in qcomm.ShardedSyncState._fields},
    **{("ParamShardSyncState", f): "pytree container"
       for f in qcomm.ParamShardSyncState._fields},
    # Handed to grad_fn unchanged: any pytree grad_fn accepts is valid.
    ("accumulate_gradients", "params"): "passed through to grad_fn",
    # Only the structure is read; any pytree (a leaf gets PartitionSpec()) is valid.
    ("state_partition_spec", "tree"): "any pytree",
    **{("DiLoCoState", f): "pytree container" for f in qcomm.DiLoCoState._fields},
    **{("ParamShard", f): "pytree container" for f in ("data", "shape", "dtype")},
    # Only waited for: any pytree of values.
    ("gather_params", "after"): "any pytree",
    # A jax checkpoint policy (a function jax calls), not a function users call.
    ("hpz_remat_policy", "prim"): "a checkpoint policy jax calls",
}


def _shard(v):
  """This device's ParamShard of an 8-element parameter over the 2 devices of _mesh()."""
  return {"w": qcomm.ParamShard(v[None], (8,), jnp.float32)}


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices("cpu")[:2]), (AX,))


def _traced(body: Callable[[jax.Array], Any]) -> Callable[[], Any]:
  """A thunk tracing ``body(local x)`` inside shard_map over AX (x: float32[4] per device)."""
  def run():
    fn = jax.shard_map(lambda v: (body(v), v)[1], mesh=_mesh(), in_specs=P(AX), out_specs=P(AX))
    return jax.eval_shape(fn, jax.ShapeDtypeStruct((8,), jnp.float32))
  return run


class Case(NamedTuple):
  callable: str  # "allreduce", "QSGD.encode", "sync().update", ...
  param: str
  run: Callable[[], Any]  # raises
  exc: type = ValueError


KEY = jax.random.key(0)
X = jnp.ones((16,), jnp.float32)
INT_X = jnp.ones((16,), jnp.int32)
BAD_SHAPE = (-5,)


def _codec_cases(name: str, codec: qcomm.Codec) -> list[Case]:
  """The array API and sizes of one codec (shared code in Codec, sizes per codec class)."""
  key = KEY if codec.needs_key else None
  try:
    payload = codec.encode(X, key)
  except ValueError:  # no standalone payload (PowerSGD): the arguments are checked before that
    payload = jnp.zeros((8,), jnp.uint8)
  payloads = jnp.stack([payload, payload])
  c = lambda m, p, run: Case(f"{name}.{m}", p, run)  # noqa: E731
  return [
      c("encode", "x", lambda: codec.encode("abc", key)),
      c("encode", "x", lambda: codec.encode(INT_X, key)),
      c("encode", "key", lambda: codec.encode(X, key=42)),
      c("encode", "key", lambda: codec.encode(X, key=jnp.zeros((3,), jnp.uint32))),
      c("decode", "payload", lambda: codec.decode([1, 2, 3], (16,))),
      c("decode", "shape", lambda: codec.decode(payload, BAD_SHAPE)),
      c("decode", "shape", lambda: codec.decode(payload, "16")),
      c("decode", "dtype", lambda: codec.decode(payload, (16,), dtype=jnp.int8)),
      c("decode", "dtype", lambda: codec.decode(payload, (16,), dtype="foo")),
      c("decode_sum", "payloads", lambda: codec.decode_sum("abc", (16,))),
      c("decode_sum", "shape", lambda: codec.decode_sum(payloads, BAD_SHAPE)),
      c("decode_sum", "dtype", lambda: codec.decode_sum(payloads, (16,), dtype=jnp.int32)),
      c("decode_sum_reencode", "payloads", lambda: codec.decode_sum_reencode(None, (16,), key)),
      c("decode_sum_reencode", "shape", lambda: codec.decode_sum_reencode(payloads, (1.5,), key)),
      c("decode_sum_reencode", "key", lambda: codec.decode_sum_reencode(payloads, (16,), key=42)),
      c("decode_sum_reencode", "scale",
        lambda: codec.decode_sum_reencode(payloads, (16,), key, scale="x")),
      c("decode_sum_reencode", "scale",
        lambda: codec.decode_sum_reencode(payloads, (16,), key, scale=float("nan"))),
      c("roundtrip", "x", lambda: codec.roundtrip(object(), key)),
      c("roundtrip", "key", lambda: codec.roundtrip(X, key="key")),
      c("payload_size", "n", lambda: codec.payload_size(-1)),
      c("payload_size", "n", lambda: codec.payload_size(2.5)),
      c("wire_size", "n", lambda: codec.wire_size(-1)),
      c("wire_bits", "devices", lambda: codec.wire_bits(0)),
      c("traffic", "n", lambda: codec.traffic(-1, 2)),
      c("traffic", "devices", lambda: codec.traffic(16, 0)),
      c("traffic", "collective", lambda: codec.traffic(16, 2, "broadcast")),
      c("sent_bytes", "n", lambda: codec.sent_bytes(1.5, 2)),
      c("sent_bytes", "devices", lambda: codec.sent_bytes(16, "2")),
      c("sent_bytes", "collective", lambda: codec.sent_bytes(16, 2, None)),
      c("resolve", "devices", lambda: codec.resolve(0)),
      c("resolve", "collective", lambda: codec.resolve(2, "broadcast")),
      c("resolve", "transport", lambda: codec.resolve(2, transport="gloo")),
  ]


#: One instance of every concrete codec class in __all__, for its methods' cases.
CODEC_INSTANCES = {"QSGD": qcomm.QSGD(4), "Cast": qcomm.Cast(), "NoCompression": qcomm.NoCompression()}
if hasattr(qcomm, "Summable"):
  CODEC_INSTANCES["Summable"] = qcomm.Summable(4)
CODEC_INSTANCES["Wire16"] = qcomm.Wire16()
CODEC_INSTANCES["Auto"] = qcomm.Auto(4)
CODEC_INSTANCES["TopK"] = qcomm.TopK(0.02, 2)
CODEC_INSTANCES["PowerSGD"] = qcomm.PowerSGD(1)


def _summable_cases() -> list[Case]:
  """Summable's constructor, the `devices` of its sizes, and the `summable` flags of sync and
  codec_for_bits (present once the Summable codec is)."""
  if not hasattr(qcomm, "Summable"):
    return []
  s, sgd = qcomm.Summable(4), optax.sgd(0.1)
  return [
      Case("Summable", "bits", lambda: qcomm.Summable(bits=1)),
      Case("Summable", "bits", lambda: qcomm.Summable(bits=4.0)),
      Case("Summable", "bucket_size", lambda: qcomm.Summable(bucket_size=12)),
      Case("Summable", "rounding", lambda: qcomm.Summable(rounding="up")),
      Case("Summable", "impl", lambda: qcomm.Summable(impl="cuda")),
      Case("Summable.traffic", "devices", lambda: s.traffic(16, 10 ** 12)),
      Case("Auto", "bits", lambda: qcomm.Auto(bits=9)),
      Case("Auto", "bits", lambda: qcomm.Auto(bits=True)),
      Case("Auto", "bucket_size", lambda: qcomm.Auto(bucket_size=12)),
      Case("Auto", "scheme", lambda: qcomm.Auto(scheme="l2")),
      Case("Auto", "scheme", lambda: qcomm.Auto(bits=1, scheme="norm")),
      Case("Auto", "rounding", lambda: qcomm.Auto(rounding="up")),
      Case("Auto", "impl", lambda: qcomm.Auto(impl="cuda")),
      Case("Wire16", "bucket_size", lambda: qcomm.Wire16(bucket_size=12)),
      Case("Wire16", "rounding", lambda: qcomm.Wire16(rounding="up")),
      Case("Wire16.traffic", "devices", lambda: qcomm.Wire16().traffic(16, 1 << 15)),
      Case("Wire16", "fields", lambda: qcomm.Wire16(fields=1)),
      Case("Wire16", "fields", lambda: qcomm.Wire16(fields="3")),
      Case("Wire16", "bucket_size", lambda: qcomm.Wire16(bucket_size=128, fields=3)),
      Case("Wire16.traffic", "devices", lambda: qcomm.Wire16(fields=3).traffic(16, 813)),
      Case("sync", "codec", lambda: qcomm.sync(sgd, codec=4)),
      Case("sync", "policy", lambda: qcomm.sync(sgd, policy={"min_size": 4})),
  ]


def _sync_update(**bad) -> Callable[[], Any]:
  """A thunk calling tx.update inside shard_map with one bad argument (the rest valid)."""
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, bits=32)

  def body(v):
    p = {"w": v}
    kwargs = dict(grads=p, state=tx.init(p), params=p)
    kwargs.update({k: f(v) for k, f in bad.items()})
    return tx.update(**kwargs)
  return _traced(body)


def _dp(**bad) -> Callable[[], Any]:
  kwargs = dict(loss_fn=lambda p, b: jnp.sum(p), tx=qcomm.sync(optax.sgd(0.1), axis_name=AX),
                mesh=_mesh(), axis_name=AX)
  kwargs.update(bad)
  return lambda: qcomm.DataParallel(**kwargs)


def _diloco_update(**bad) -> Callable[[], Any]:
  """A thunk calling a diloco transformation's update inside shard_map with one bad argument."""
  tx = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2, codec=qcomm.NoCompression())

  def body(v):
    p = {"w": v}
    kwargs = dict(grads=p, state=tx.init(p), params=p)
    kwargs.update({k: f(v) for k, f in bad.items()})
    return tx.update(**kwargs)
  return _traced(body)


def _local_params(**bad) -> Callable[[], Any]:
  tx = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2)
  p = {"w": X}
  kwargs = dict(opt_state=tx.init(p), params=p)
  kwargs.update(bad)
  return lambda: qcomm.local_params(**kwargs)


def _description(**bad) -> Callable[[], Any]:
  kwargs = dict(leaves=(), devices=2, accum_steps=1, axis_name=AX, default_codec=qcomm.QSGD())
  kwargs.update(bad)
  return lambda: qcomm.Description(**kwargs)


def _cases() -> list[Case]:
  sgd = optax.sgd(0.1)
  tx = qcomm.sync(sgd, axis_name=AX)
  mesh = _mesh()
  loss = lambda p, b: jnp.sum(p)  # noqa: E731
  q = qcomm.QSGD(4)
  c = Case
  cases = [
      # -- codecs ----------------------------------------------------------------------------------
      c("QSGD", "bits", lambda: qcomm.QSGD(bits=9)),
      c("QSGD", "bits", lambda: qcomm.QSGD(bits="4")),
      c("QSGD", "bucket_size", lambda: qcomm.QSGD(bucket_size=12)),
      c("QSGD", "scheme", lambda: qcomm.QSGD(scheme="l2")),
      c("QSGD", "rounding", lambda: qcomm.QSGD(rounding="up")),
      c("QSGD", "impl", lambda: qcomm.QSGD(impl="cuda")),
      c("Cast", "dtype", lambda: qcomm.Cast("foo")),
      c("Cast", "dtype", lambda: qcomm.Cast(jnp.float32)),
      c("codec_for_bits", "bits", lambda: qcomm.codec_for_bits(12)),
      c("codec_for_bits", "bits", lambda: qcomm.codec_for_bits(4.0)),
      c("codec_for_bits", "bucket_size", lambda: qcomm.codec_for_bits(4, bucket_size=0)),
      c("codec_for_bits", "bucket_size", lambda: qcomm.codec_for_bits(32, bucket_size=12)),
      c("codec_for_bits", "scheme", lambda: qcomm.codec_for_bits(16, scheme="x")),
      c("codec_for_bits", "rounding", lambda: qcomm.codec_for_bits(4, rounding="x")),
      # -- policy and topology ---------------------------------------------------------------------
      c("LeafPolicy", "min_size", lambda: qcomm.LeafPolicy(min_size=-1)),
      c("LeafPolicy", "compress_1d", lambda: qcomm.LeafPolicy(compress_1d="no")),
      c("LeafPolicy", "exclude", lambda: qcomm.LeafPolicy(exclude=5)),
      c("LeafPolicy", "exclude", lambda: qcomm.LeafPolicy(exclude=["("])),
      c("LeafPolicy", "exclude", lambda: qcomm.LeafPolicy(exclude=[b"bias"])),
      c("LeafPolicy", "overrides", lambda: qcomm.LeafPolicy(overrides=5)),
      c("LeafPolicy", "overrides", lambda: qcomm.LeafPolicy(overrides={"w": "qsgd"})),
      c("LeafPolicy", "overrides", lambda: qcomm.LeafPolicy(overrides=[("w",)])),
      c("Hierarchical", "inner", lambda: qcomm.Hierarchical(inner=["i"], outer="o")),
      c("Hierarchical", "outer", lambda: qcomm.Hierarchical(inner="i", outer=None)),
      c("Hierarchical", "outer", lambda: qcomm.Hierarchical(inner=("i", "o"), outer="o")),
      # -- collectives (traced inside shard_map over AX) -------------------------------------------
      c("allreduce", "x", _traced(lambda v: qcomm.allreduce(v.astype(jnp.int32), AX, q, KEY))),
      c("allreduce", "axis_name", _traced(lambda v: qcomm.allreduce(v, [AX], q, KEY))),
      c("allreduce", "axis_name", _traced(lambda v: qcomm.allreduce(v, "nope", q, KEY))),
      c("allreduce", "codec", _traced(lambda v: qcomm.allreduce(v, AX, "qsgd", KEY))),
      c("allreduce", "key", _traced(lambda v: qcomm.allreduce(v, AX, q, key=42))),
      c("allreduce", "op", _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, op="max"))),
      c("allreduce", "policy", _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, policy="foo"))),
      c("allreduce", "comm_bucket_size",
        _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, comm_bucket_size=0))),
      c("allreduce", "return_residual",
        _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, return_residual="yes"))),
      c("allreduce", "check_varying",
        _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, check_varying="no"))),
      c("allreduce", "exchange", _traced(lambda v: qcomm.allreduce(v, AX, q, KEY, exchange="x"))),
      c("reduce_scatter", "x",
        _traced(lambda v: qcomm.reduce_scatter(v.astype(jnp.int32), AX, q, KEY))),
      c("reduce_scatter", "x", _traced(lambda v: qcomm.reduce_scatter([1.0, 2.0], AX, q, KEY))),
      c("reduce_scatter", "axis_name", _traced(lambda v: qcomm.reduce_scatter(v, None, q, KEY))),
      c("reduce_scatter", "codec", _traced(lambda v: qcomm.reduce_scatter(v, AX, 4, KEY))),
      c("reduce_scatter", "key", _traced(lambda v: qcomm.reduce_scatter(v, AX, q, key=1))),
      c("reduce_scatter", "op", _traced(lambda v: qcomm.reduce_scatter(v, AX, q, KEY, op="x"))),
      c("reduce_scatter", "check_varying",
        _traced(lambda v: qcomm.reduce_scatter(v, AX, q, KEY, check_varying=1))),
      c("reduce_scatter", "exchange",
        _traced(lambda v: qcomm.reduce_scatter(v, AX, q, KEY, exchange="x"))),
      c("all_gather", "x", _traced(lambda v: qcomm.all_gather(v.astype(jnp.int32), AX))),
      c("all_gather", "axis_name", _traced(lambda v: qcomm.all_gather(v, {AX: 1}))),
      c("all_gather", "codec", _traced(lambda v: qcomm.all_gather(v, AX, codec=None))),
      c("all_gather", "key", _traced(lambda v: qcomm.all_gather(v, AX, key="k"))),
      c("all_gather", "tiled", _traced(lambda v: qcomm.all_gather(v, AX, tiled="yes"))),
      c("cast_pmean", "x", _traced(lambda v: qcomm.cast_pmean(v.astype(jnp.int32), AX))),
      c("cast_pmean", "axis_name", _traced(lambda v: qcomm.cast_pmean(v, ["d"]))),
      c("cast_pmean", "dtype", _traced(lambda v: qcomm.cast_pmean(v, AX, dtype=jnp.int8))),
      c("cast_pmean", "dtype", _traced(lambda v: qcomm.cast_pmean(v, AX, dtype="foo"))),
      c("cast_pmean", "check_varying",
        _traced(lambda v: qcomm.cast_pmean(v, AX, check_varying="no"))),
      # -- sync and its transformation -------------------------------------------------------------
      c("sync", "inner", lambda: qcomm.sync(None)),
      c("sync", "axis_name", lambda: qcomm.sync(sgd, axis_name=None)),
      c("sync", "axis_name", lambda: qcomm.sync(sgd, axis_name=["data"])),
      c("sync", "bits", lambda: qcomm.sync(sgd, bits=9)),
      c("sync", "bucket_size", lambda: qcomm.sync(sgd, bucket_size=12)),
      c("sync", "bucket_size", lambda: qcomm.sync(sgd, bits=32, bucket_size=-8)),
      c("sync", "accum_steps", lambda: qcomm.sync(sgd, accum_steps=0)),
      c("sync", "min_size", lambda: qcomm.sync(sgd, min_size=-1)),
      c("sync", "exclude", lambda: qcomm.sync(sgd, exclude=5)),
      c("sync", "error_feedback", lambda: qcomm.sync(sgd, error_feedback="yes")),
      c("sync", "comm_bucket_size", lambda: qcomm.sync(sgd, comm_bucket_size=0)),
      c("sync", "seed", lambda: qcomm.sync(sgd, seed="0")),
      c("sync", "check_varying", lambda: qcomm.sync(sgd, check_varying="yes")),
      c("sync", "shard_state", lambda: qcomm.sync(sgd, shard_state=1)),
      c("sync", "gather_codec", lambda: qcomm.sync(sgd, shard_state=True, gather_codec="q8")),
      c("sync", "shard_params", lambda: qcomm.sync(sgd, shard_params=1)),
      c("sync", "param_codec", lambda: qcomm.sync(sgd, shard_params=True, param_codec="q8")),
      c("sync", "hpz", lambda: qcomm.sync(sgd, shard_params=True, hpz="yes")),
      c("clip_by_global_norm", "max_norm", lambda: qcomm.clip_by_global_norm("1")),
      c("sync().init", "params", lambda: tx.init({"w": "abc"})),
      c("sync().update", "grads", _sync_update(grads=lambda v: {"w": v.astype(jnp.int32)})),
      c("sync().update", "state", _sync_update(state=lambda v: "state"), TypeError),
      c("sync().update", "params", _sync_update(params=lambda v: {"a": v, "b": v})),
      c("state_partition_spec", "axis_name", lambda: qcomm.state_partition_spec({}, ["data"])),
      c("state_partition_spec", "params",
        lambda: qcomm.state_partition_spec({}, "data", params={"w": "abc"})),
      c("gather_params", "shards", _traced(lambda v: qcomm.gather_params({"w": v}, AX))),
      c("gather_params", "axis_name", _traced(lambda v: qcomm.gather_params(_shard(v), "nope"))),
      c("gather_params", "codec", _traced(lambda v: qcomm.gather_params(_shard(v), AX, "q8"))),
      c("gather_params", "grad_codec",
        _traced(lambda v: qcomm.gather_params(_shard(v), AX, grad_codec="q4"))),
      c("gather_params", "key", _traced(lambda v: qcomm.gather_params(_shard(v), AX, key="k"))),
      c("gather_params", "check_layout",
        _traced(lambda v: qcomm.gather_params(_shard(v), AX, check_layout="yes"))),
      c("shard_params", "params", lambda: qcomm.shard_params({"w": "abc"}, 2)),
      c("shard_params", "devices", lambda: qcomm.shard_params({"w": X}, 0)),
      c("shard_params", "layers", lambda: qcomm.shard_params({"w": X}, 2, layers=5)),
      c("unshard_params", "tree", lambda: qcomm.unshard_params({"w": X})),
      c("reshard_params", "tree", lambda: qcomm.reshard_params({"w": X}, 2)),
      c("reshard_params", "devices",
        lambda: qcomm.reshard_params(qcomm.shard_params({"w": X}, 2), 0)),
      c("shard_specs", "tree", lambda: qcomm.shard_specs({"w": X}, "data")),
      c("shard_specs", "axis_name",
        lambda: qcomm.shard_specs(qcomm.shard_params({"w": X}, 2), ["data"])),
      c("gather_params", "hpz", _traced(lambda v: qcomm.gather_params(_shard(v), AX, hpz="yes"))),
      c("gather_params", "index", _traced(lambda v: qcomm.gather_params(_shard(v), AX, index=0.5))),
      c("describe", "regather", lambda: qcomm.describe(
          qcomm.sync(sgd, shard_params=True), {"w": jnp.ones((4, 4))}, devices=2,
          regather="yes")),
      c("accumulate_gradients", "grad_fn",
        lambda: qcomm.accumulate_gradients(5, {}, (jnp.ones((4, 2)),), 2)),
      c("accumulate_gradients", "batch",
        lambda: qcomm.accumulate_gradients(loss, {}, ("abc",), 2)),
      c("accumulate_gradients", "batch",
        lambda: qcomm.accumulate_gradients(loss, {}, (jnp.ones((3, 2)),), 2)),
      c("accumulate_gradients", "accum_steps",
        lambda: qcomm.accumulate_gradients(loss, {}, (jnp.ones((4, 2)),), 0)),
      # -- data parallel -----------------------------------------------------------------------------
      c("data_parallel", "loss_fn", lambda: qcomm.data_parallel(None, tx, mesh, axis_name=AX)),
      c("data_parallel", "tx", lambda: qcomm.data_parallel(loss, "adam", mesh, axis_name=AX)),
      c("data_parallel", "mesh", lambda: qcomm.data_parallel(loss, tx, "mesh", axis_name=AX)),
      c("data_parallel", "axis_name", lambda: qcomm.data_parallel(loss, tx, mesh, axis_name="x")),
      c("data_parallel", "axis_name", lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=[AX])),
      c("data_parallel", "has_aux",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, has_aux=1)),
      c("data_parallel", "aux_reduce",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, aux_reduce="max")),
      c("data_parallel", "batch_spec",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, batch_spec=("d",))),
      c("data_parallel", "donate",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, donate="yes")),
      c("data_parallel", "elastic",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, elastic="yes")),
      c("data_parallel", "overlap",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, overlap="yes")),
      c("DataParallel", "loss_fn", _dp(loss_fn=3)),
      c("DataParallel", "tx", _dp(tx=None)),
      c("DataParallel", "mesh", _dp(mesh=None)),
      c("DataParallel", "axis_name", _dp(axis_name="nope")),
      c("DataParallel", "has_aux", _dp(has_aux="no")),
      c("DataParallel", "aux_reduce", _dp(aux_reduce=None)),
      c("DataParallel", "batch_spec", _dp(batch_spec="d")),
      c("DataParallel", "donate", _dp(donate=None)),
      c("DataParallel", "param_spec", _dp(param_spec={"w": "model"})),
      c("data_parallel", "param_spec",
        lambda: qcomm.data_parallel(loss, tx, mesh, axis_name=AX, param_spec={"w": P(AX)})),
      # -- describe ----------------------------------------------------------------------------------
      c("describe", "tx", lambda: qcomm.describe(sgd, {"w": X})),
      c("describe", "params", lambda: qcomm.describe(tx, {"w": "abc"})),
      c("describe", "devices", lambda: qcomm.describe(tx, {"w": X}, devices=0)),
      c("Description", "leaves", _description(leaves=[1])),
      c("Description", "devices", _description(devices=0)),
      c("Description", "accum_steps", _description(accum_steps=-1)),
      c("Description", "axis_name", _description(axis_name=None)),
      c("Description", "default_codec", _description(default_codec="qsgd")),
      c("Description", "default_runs", _description(default_runs="qsgd")),
      # -- diloco ----------------------------------------------------------------------------------
      c("diloco", "inner", lambda: qcomm.diloco(None, axis_name=AX, every=2)),
      c("diloco", "axis_name", lambda: qcomm.diloco(sgd, axis_name=["d"], every=2)),
      c("diloco", "axis_name", lambda: qcomm.diloco(qcomm.sync(sgd, axis_name=AX), axis_name=AX,
                                                    every=2).init({"w": X})),
      c("diloco", "residual_decay", lambda: qcomm.diloco(sgd, axis_name=AX, every=2,
                                                         outer="sparseloco", residual_decay=1.5)),
      c("diloco", "residual_decay", lambda: qcomm.diloco(sgd, axis_name=AX, every=2,
                                                         codec=qcomm.QSGD(4), residual_decay=0.5)),
      c("diloco", "outer", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, outer="demo")),
      c("diloco", "every", lambda: qcomm.diloco(sgd, axis_name=AX, every=0)),
      c("diloco", "every", lambda: qcomm.diloco(sgd, axis_name=AX, every=2.5)),
      c("diloco", "codec", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, codec=4)),
      c("diloco", "outer", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, outer=0.7)),
      c("diloco", "error_feedback",
        lambda: qcomm.diloco(sgd, axis_name=AX, every=2, error_feedback="yes")),
      c("diloco", "policy", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, policy={})),
      c("diloco", "comm_bucket_size",
        lambda: qcomm.diloco(sgd, axis_name=AX, every=2, comm_bucket_size=0)),
      c("diloco", "seed", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, seed="0")),
      c("diloco", "fragments", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, fragments=0)),
      c("diloco", "fragments", lambda: qcomm.diloco(sgd, axis_name=AX, every=4, fragments=3)),
      c("diloco", "fragments", lambda: qcomm.diloco(sgd, axis_name=AX, every=4, fragments=2.0)),
      c("diloco", "delay", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, delay=2)),
      c("diloco", "delay", lambda: qcomm.diloco(sgd, axis_name=AX, every=2, delay=True)),
      c("diloco().init", "params",
        lambda: qcomm.diloco(sgd, axis_name=AX, every=2).init({"w": "abc"})),
      c("diloco().update", "grads",
        _diloco_update(grads=lambda v: {"w": v.astype(jnp.int32)})),
      c("diloco().update", "state", _diloco_update(state=lambda v: "state"), TypeError),
      c("diloco().update", "params", _diloco_update(params=lambda v: {"w": v * 2.0})),
      c("diloco().update", "params", _diloco_update(params=lambda v: {"a": v, "b": v})),
      c("TopK", "fraction", lambda: qcomm.TopK(fraction=0.0)),
      c("TopK", "fraction", lambda: qcomm.TopK(fraction=1.5)),
      c("TopK", "bits", lambda: qcomm.TopK(bits=3)),
      c("TopK", "chunk", lambda: qcomm.TopK(chunk=100)),
      c("TopK", "chunk", lambda: qcomm.TopK(chunk=1 << 17)),
      c("PowerSGD", "rank", lambda: qcomm.PowerSGD(0)),
      c("PowerSGD", "rank", lambda: qcomm.PowerSGD(1.5)),
      c("PowerSGD", "min_compression_rate", lambda: qcomm.PowerSGD(1, min_compression_rate=0.5)),
      c("PowerSGD", "min_compression_rate", lambda: qcomm.PowerSGD(1, min_compression_rate="2")),
      c("self_test", "verbose", lambda: qcomm.self_test(verbose="yes")),
      c("local_params", "opt_state", lambda: (lambda s: qcomm.local_params((s, s), {"w": X}))(
          qcomm.diloco(sgd, axis_name=AX, every=2).init({"w": X}))),
      c("local_params", "params", _local_params(params={"v": X})),
      c("Description", "scalar_bytes", _description(scalar_bytes=-1.0)),
      c("Description", "state_bytes_per_device", _description(state_bytes_per_device=1.5)),
  ]
  for name, codec in CODEC_INSTANCES.items():
    cases += _codec_cases(name, codec)
  return cases + _summable_cases()


CASES = _cases()


def _params(fn: Any) -> list[str]:
  """The parameter names of fn, without `self` of methods and without *args / **kwargs."""
  out = []
  for p in inspect.signature(fn).parameters.values():
    if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    out.append(p.name)
  return out


def public_parameters() -> set[tuple[str, str]]:
  """(callable, parameter) for every public callable, read from the signatures."""
  found = set()
  for name in qcomm.__all__:
    obj = getattr(qcomm, name)
    if not callable(obj):
      continue
    found |= {(name, p) for p in _params(obj)}
    if inspect.isclass(obj) and issubclass(obj, qcomm.Codec) and not inspect.isabstract(obj):
      for method in CODEC_METHODS:
        found |= {(f"{name}.{method}", p) for p in _params(getattr(obj, method))}
  tx = qcomm.sync(optax.sgd(0.1))
  found |= {("sync().init", p) for p in _params(tx.init)}
  found |= {("sync().update", p) for p in _params(tx.update)}
  tx = qcomm.diloco(optax.sgd(0.1), axis_name="d", every=2)
  found |= {("diloco().init", p) for p in _params(tx.init)}
  found |= {("diloco().update", p) for p in _params(tx.update)}
  return found


def test_every_public_parameter_has_a_case():
  public = public_parameters()
  covered = {(case.callable, case.param) for case in CASES} | set(EXEMPT)
  missing = sorted(public - covered)
  assert not missing, (
      "public parameters without a bad-argument case in tests/test_bad_arguments.py (add a check "
      f"naming the parameter and a case): {missing}")
  stale = sorted(covered - public)
  assert not stale, f"cases or exemptions for parameters that do not exist: {stale}"
  concrete = {n for n in qcomm.__all__ if inspect.isclass(getattr(qcomm, n))
              and issubclass(getattr(qcomm, n), qcomm.Codec)
              and not inspect.isabstract(getattr(qcomm, n))}
  assert concrete <= set(CODEC_INSTANCES), (
      f"codec classes without an instance in CODEC_INSTANCES: {sorted(concrete - set(CODEC_INSTANCES))}")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.callable}-{c.param}-{i}" for i, c in enumerate(CASES)])
def test_bad_argument_raises_naming_the_parameter(case):
  with pytest.raises(case.exc) as info:
    case.run()
  message = str(info.value)
  assert re.search(rf"(?<![\w]){re.escape(case.param)}(?![\w])", message), (
      f"the message does not name {case.param!r}: {message}")
  assert "must" in message, f"the message does not say what is allowed: {message}"


# ---- the offenders reported from outside, by exact message ---------------------------------------

def test_cast_pmean_integer_dtype_is_an_error_not_a_truncation():
  with pytest.raises(ValueError, match=r"^dtype must be a floating dtype \(float32, bfloat16 or "
                                       r"float16\), got int8"):
    _traced(lambda v: qcomm.cast_pmean(v, AX, dtype=jnp.int8))()


def test_leaf_policy_compress_1d_must_be_a_bool():
  with pytest.raises(ValueError, match=r"^compress_1d must be True or False, got 'no'"):
    qcomm.LeafPolicy(compress_1d="no")


def test_codec_key_and_shape_errors_name_the_parameter():
  with pytest.raises(ValueError, match=r"^key must be a JAX PRNG key .*got 42"):
    qcomm.QSGD().encode(X, key=42)
  with pytest.raises(ValueError, match=r"^shape must be a tuple of non-negative integers, got \(-5,\)"):
    qcomm.QSGD().decode(qcomm.QSGD().encode(X, KEY), shape=(-5,))


def test_valid_keys_still_accepted():
  """Typed keys, raw uint32[2] keys, and NumPy raw keys: the conventions of jax.random."""
  q = qcomm.QSGD(4)
  a = q.encode(X, jax.random.key(3))
  b = q.encode(X, jax.random.PRNGKey(3))
  c = q.encode(X, np.asarray(jax.random.PRNGKey(3)))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


_Q = qcomm.QSGD()
_PAYLOADS = jnp.stack([_Q.encode(X, KEY)] * 2)

#: The offenders reported from outside (issue 16) and the first line of their message now.
OFFENDERS = [
    (_traced(lambda v: qcomm.cast_pmean(v, AX, dtype=jnp.int8)),
     "dtype must be a floating dtype (float32, bfloat16 or float16), got int8"),
    (_traced(lambda v: qcomm.cast_pmean(v, AX, dtype="foo")),
     "dtype must be a floating dtype (float32, bfloat16 or float16), got 'foo'"),
    (lambda: qcomm.LeafPolicy(compress_1d="no"),
     "compress_1d must be True or False, got 'no'"),
    (lambda: _Q.encode(X, key=42),
     "key must be a JAX PRNG key (jax.random.key(...), or the raw uint32[2] of "
     "jax.random.PRNGKey(...)), got 42"),
    (lambda: _Q.decode(_PAYLOADS[0], shape=(-5,)),
     "shape must be a tuple of non-negative integers, got (-5,)"),
    (lambda: _Q.decode_sum_reencode(_PAYLOADS, (16,), KEY, scale="x"),
     "scale must be a finite real number, got 'x'"),
    (_traced(lambda v: qcomm.allreduce(v, AX, _Q, KEY, policy="foo")),
     "policy must be None or a qcomm.LeafPolicy, got 'foo'"),
    (lambda: qcomm.Cast("foo"), "dtype must be bfloat16 or float16, got 'foo'"),
    (lambda: qcomm.sync(optax.sgd(0.1), exclude=5),
     "exclude must be a regular expression or a sequence of them, got 5"),
]


@pytest.mark.parametrize("run, message", OFFENDERS, ids=[m.split(",")[0] for _, m in OFFENDERS])
def test_reported_offenders_raise_the_stated_message(run, message):
  with pytest.raises(ValueError) as info:
    run()
  assert str(info.value).splitlines()[0] == message
