"""The codec interface (jax_qcomm.Codec) is enough to add a codec: two codecs written here, in the
test file, with no change to the library, run end to end through qcomm.allreduce, reduce_scatter,
all_gather, qcomm.sync, qcomm.describe and the cost model.

* ``Fp8`` -- a float8 (e4m3fn) cast: one byte per value on the wire, float32 sums.
* ``Int8Block`` -- blocks of 8 values sharing one float32 scale (max |x| / 127), codes rounded to
  nearest: exercises ``pad_multiple`` (no block straddles two leaves or two devices' chunks), its
  ``pad_fill`` and a payload of two parts (scales, then codes).

The oracle is the codec's own array API run on the host: the scatter-reduce-allgather's result for
chunk j is ``decode(encode(decode_sum(payloads of chunk j from every device) * float32(1/D)))``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.tools import efficiency

D = 4
AX = "data"


@dataclasses.dataclass(frozen=True)
class Fp8(qcomm.Codec):
  """float8_e4m3fn on the wire (round to nearest even), float32 accumulation."""

  def payload_size(self, n: int) -> int:
    return n

  def wire_bits(self, devices: int = 1) -> float:
    return 8.0

  def wire_encode(self, x, key):
    return lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)

  def wire_decode_sum(self, wires, n):
    vals = lax.bitcast_convert_type(wires, jnp.float8_e4m3fn).astype(jnp.float32)
    out = vals[0]
    for j in range(1, vals.shape[0]):  # in order, as the interface requires
      out = out + vals[j]
    return out


@dataclasses.dataclass(frozen=True)
class Int8Block(qcomm.Codec):
  """Blocks of 8 values: a float32 scale (max |x| / 127) and 8 int8 codes; payload = the n/8
  scales' bytes, then the n codes."""

  block: int = 8

  @property
  def pad_multiple(self) -> int:
    return self.block

  def pad_fill(self, x):
    return jnp.float32(0)  # 0 never raises a block's max |x|

  def payload_size(self, n: int) -> int:
    blocks = -(-n // self.block)
    return 4 * blocks + blocks * self.block

  def wire_bits(self, devices: int = 1) -> float:
    return 8.0 + 32.0 / self.block

  def wire_encode(self, x, key):
    n = x.shape[0]
    blocks = -(-n // self.block)
    xb = jnp.pad(x, (0, blocks * self.block - n)).reshape(blocks, self.block)
    scale = jnp.max(jnp.abs(xb), axis=1) / jnp.float32(127)
    safe = jnp.where(scale > 0, scale, jnp.float32(1))
    codes = jnp.clip(jnp.round(xb / safe[:, None]), -127, 127).astype(jnp.int8)
    return jnp.concatenate([lax.bitcast_convert_type(scale, jnp.uint8).reshape(-1),
                            lax.bitcast_convert_type(codes, jnp.uint8).reshape(-1)])

  def wire_decode_sum(self, wires, n):
    blocks = -(-n // self.block)
    k = wires.shape[0]
    scale = lax.bitcast_convert_type(wires[:, :4 * blocks].reshape(k, blocks, 4), jnp.float32)
    codes = lax.bitcast_convert_type(wires[:, 4 * blocks:], jnp.int8).reshape(k, blocks, self.block)
    vals = (codes.astype(jnp.float32) * scale[:, :, None]).reshape(k, -1)[:, :n]
    out = vals[0]
    for j in range(1, k):
      out = out + vals[j]
    return out


CODECS = [Fp8(), Int8Block()]


@functools.cache
def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:D]), (AX,))


def _smap(f, in_specs, out_specs):
  return jax.jit(jax.shard_map(f, mesh=mesh(), in_specs=in_specs, out_specs=out_specs))


def _sra_oracle(codec: qcomm.Codec, x: np.ndarray) -> np.ndarray:
  """The mean allreduce of x[D, n] as the scatter-reduce-allgather computes it, from the codec's
  array API on the host (chunks padded with zeros to whole ``D * pad_multiple``)."""
  d, n = x.shape
  n_pad = codec.buffer_length(n, d)
  c = n_pad // d
  xp = np.pad(x, ((0, 0), (0, n_pad - n)))
  out = []
  for j in range(d):
    payloads = jnp.stack([codec.encode(jnp.asarray(xp[i, j * c:(j + 1) * c])) for i in range(d)])
    reduced = codec.decode_sum(payloads, (c,)) * jnp.float32(1.0 / d)
    out.append(np.asarray(codec.roundtrip(reduced)))
  return np.concatenate(out)[:n]


def _grads(seed: int, shape) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal((D,) + shape).astype(np.float32)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_array_api_comes_from_the_interface(codec):
  x = jnp.asarray(_grads(0, (37,))[0])
  payload = codec.encode(x)
  assert payload.dtype == jnp.uint8 and payload.shape == (codec.payload_size(37),)
  assert codec.wire_size(37) == codec.payload_size(37) and codec.lossy and not codec.needs_key
  back = codec.decode(payload, (37,))
  assert back.shape == (37,) and float(jnp.max(jnp.abs(back - x))) < 0.15 * float(jnp.max(jnp.abs(x)))
  with pytest.raises(ValueError, match="payload"):
    codec.decode(payload[:-1], (37,))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_allreduce_runs_the_sra_with_a_codec_defined_here(codec):
  n = 1001  # not a multiple of D * pad_multiple: the allreduce pads
  x = _grads(1, (n,))
  f = _smap(lambda v: qcomm.allreduce(v[0], AX, codec)[None], P(AX), P(AX))
  out = np.asarray(f(x))
  assert out.shape == (D, n)
  for i in range(1, D):  # every replica decodes the same payloads: bit-identical
    np.testing.assert_array_equal(out[i].view(np.uint32), out[0].view(np.uint32))
  np.testing.assert_allclose(out[0], _sra_oracle(codec, x), rtol=1e-6, atol=1e-7)
  assert np.abs(out[0] - x.mean(0)).max() < 0.1 * np.abs(x).max()
  # The cost model counts its bytes from the codec's own payload_size and the allreduce's padding.
  c = codec.buffer_length(n, D) // D
  assert codec.sent_bytes(n, D) == pytest.approx(2 * (D - 1) / D * D * codec.payload_size(c))
  assert efficiency.allreduce_bytes(n, D, codec) == codec.sent_bytes(n, D)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_reduce_scatter_and_all_gather(codec):
  x = _grads(2, (D * 16,))
  rs = _smap(lambda v: qcomm.reduce_scatter(v[0], AX, codec)[None], P(AX), P(AX))
  got = np.asarray(rs(x))  # [D, 16]: device j's reduced block
  for j in range(D):
    payloads = jnp.stack([codec.encode(jnp.asarray(x[i, 16 * j:16 * (j + 1)])) for i in range(D)])
    want = np.asarray(codec.decode_sum(payloads, (16,)) * jnp.float32(1.0 / D))
    np.testing.assert_allclose(got[j], want, rtol=1e-6, atol=1e-7)
  ag = _smap(lambda v: qcomm.all_gather(v[0], AX, codec)[None], P(AX), P(AX))
  gathered = np.asarray(ag(x))  # [D, D, D*16]
  for i in range(D):
    np.testing.assert_allclose(gathered[0, i], np.asarray(codec.roundtrip(jnp.asarray(x[i]))),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(gathered[i], gathered[0])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_sync_with_a_codec_defined_here(codec):
  """qcomm.sync sends the leaves its policy's overrides name with the custom codec, the rest
  exact."""
  params = {"w": jnp.zeros((40, 25)), "b": jnp.zeros((25,))}
  grads = {"w": _grads(3, (40, 25)), "b": _grads(4, (25,))}
  tx = qcomm.sync(optax.sgd(1.0), axis_name=AX, codec=qcomm.NoCompression(),
                  policy=qcomm.LeafPolicy(overrides={"w": codec}))
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = _smap(tx.init, P(), spec)(params)

  def step(p, s, g):
    u, _ = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return u

  updates = _smap(step, (P(), spec, P(AX)), P())(params, state, grads)
  # w: the custom codec's allreduce (packed alone in its buffer, so the same SRA as above)
  np.testing.assert_allclose(np.asarray(updates["w"]).reshape(-1),
                             -_sra_oracle(codec, grads["w"].reshape(D, -1)), rtol=1e-6, atol=1e-7)
  # b: 1-D and small, exact (the default bits=32)
  np.testing.assert_allclose(np.asarray(updates["b"]), -grads["b"].mean(0), rtol=1e-6, atol=1e-7)
  by_path = {leaf.path: leaf for leaf in qcomm.describe(tx, params, devices=D).leaves}
  assert by_path["w"].codec == codec and by_path["w"].payload_bytes == codec.payload_size(1000)
  assert codec.name in str(qcomm.describe(tx, params, devices=D))
