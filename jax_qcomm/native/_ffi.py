"""Loading the compiled kernels and registering them as XLA FFI targets (once, at import).

The binding is thin on purpose: each function here is one `jax.ffi.ffi_call` whose operands are
already flat float32 / uint8 arrays; validation and reshaping live in `jax_qcomm.codecs`.

Two environment variables, read once when this module is imported:

* ``QCOMM_CPU_ISA=avx512|avx2|generic`` runs the CPU kernels built for that instruction set instead
  of the widest one the CPU supports (all give the same bytes; this is for testing and for
  comparing their speed). Asking for one this CPU lacks, or an unknown name, raises ValueError at
  import: a run that asked for an ISA never silently runs another.
* ``QCOMM_CPU_MODULE=/path/to/_qcomm_cpu....so`` loads that build of the CPU module instead of the
  installed one (scripts/sanitize.sh: the module built with AddressSanitizer and UBSan).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

from jax_qcomm import _compat
from jax_qcomm.native import wire

CPU_ISA_ENV = "QCOMM_CPU_ISA"
CPU_MODULE_ENV = "QCOMM_CPU_MODULE"


def _load_cpu_module():
  """The CPU module: the build named by $QCOMM_CPU_MODULE, else the installed one (or None)."""
  path = os.environ.get(CPU_MODULE_ENV, "")
  if not path:
    try:  # The CPU module is always built; a source checkout without a build has none.
      from jax_qcomm import _qcomm_cpu  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - exercised only on unbuilt checkouts
      return None
    return _qcomm_cpu
  if not os.path.isfile(path):
    raise ImportError(f"{CPU_MODULE_ENV}={path!r}: no such file (a built _qcomm_cpu module)")
  spec = importlib.util.spec_from_file_location("jax_qcomm._qcomm_cpu", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sys.modules["jax_qcomm._qcomm_cpu"] = module
  return module


def _apply_isa_override(module) -> None:
  """Runs the kernels of $QCOMM_CPU_ISA if set; ValueError if unknown or not supported here."""
  name = os.environ.get(CPU_ISA_ENV, "").strip()
  if not name or module is None:
    return
  try:
    module.force_isa(name)
  except ValueError as e:
    raise ValueError(f"{CPU_ISA_ENV}={name!r}: {e}") from None


_qcomm_cpu = _load_cpu_module()
_apply_isa_override(_qcomm_cpu)

try:  # The CUDA module exists only where the build found nvcc.
  from jax_qcomm import _qcomm_cuda  # type: ignore[attr-defined]
except ImportError:
  _qcomm_cuda = None

_registered = False


def register() -> None:
  """Registers every compiled FFI target with XLA. Idempotent."""
  global _registered
  if _registered:
    return
  for module, platform in ((_qcomm_cpu, "cpu"), (_qcomm_cuda, "CUDA")):
    if module is not None:
      for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
  _registered = True


def has_cpu_kernels() -> bool:
  return _qcomm_cpu is not None


def has_cuda_kernels() -> bool:
  return _qcomm_cuda is not None


def cpu_isa() -> str | None:
  """The instruction set the CPU kernels run ("avx512", "avx2", "generic"), or None without them:
  the widest this CPU supports, or the one $QCOMM_CPU_ISA asked for."""
  return None if _qcomm_cpu is None else _qcomm_cpu.isa()


def cpu_isa_detected() -> str | None:
  """The widest instruction set this CPU supports and the build has kernels for, or None."""
  return None if _qcomm_cpu is None else _qcomm_cpu.detected_isa()


def implementation() -> dict[str, str]:
  """What ``impl="auto"`` codecs run on each platform: ``"ffi (C++, <isa>)"`` / ``"ffi (CUDA)"``
  where a compiled module was built into this install, else ``"jax (pure-JAX reference)"``.
  Public as ``jax_qcomm.implementation()``."""
  ref = "jax (pure-JAX reference)"
  return {"cpu": f"ffi (C++, {cpu_isa()})" if has_cpu_kernels() else ref,
          "cuda": "ffi (CUDA)" if has_cuda_kernels() else ref}


def _varying_call(target: str, results, vmap_method: str, operands, attrs):
  """One ``jax.ffi.ffi_call`` of a registered target; every result varies over the manual axes
  any operand varies over (shard_map's vma types: XLA cannot infer them through a custom call)."""
  out = jax.ffi.ffi_call(target, results, vmap_method=vmap_method)(*operands, **attrs)
  vma = frozenset().union(*(_compat.vma_of(x) for x in operands))
  if isinstance(out, (list, tuple)):
    return [_compat.make_varying(o, vma) for o in out]
  return _compat.make_varying(out, vma)


def _call(target: str, shape: tuple[int, ...], dtype, *operands: jax.Array, **attrs) -> jax.Array:
  """One call of a kernel on an array (leading batch rows under vmap)."""
  return _varying_call(target, jax.ShapeDtypeStruct(shape, dtype), "broadcast_all", operands,
                       attrs)


def _attrs(bits: int, bucket_size: int, scheme: str | None = None, rounding: str | None = None,
           **more) -> dict:
  """The kernels' attributes as the fixed-width scalars their FFI signatures declare."""
  out = dict(bits=np.int32(bits), bucket_size=np.int32(bucket_size), **more)
  if scheme is not None:
    out["scheme"] = np.int32(wire.SCHEMES.index(scheme))
  if rounding is not None:
    out["rounding"] = np.int32(wire.ROUNDINGS.index(rounding))
  return out


def qsgd_encode(x: jax.Array, seed: jax.Array, *, bits: int, bucket_size: int, scheme: str,
                rounding: str) -> jax.Array:
  """x: float32[n], seed: uint32[2] -> uint8[payload_bytes]."""
  size = wire.qsgd_payload_bytes(x.shape[-1], bits, bucket_size, scheme)
  return _call("qcomm_qsgd_encode", (size,), jnp.uint8, x, seed,
               **_attrs(bits, bucket_size, scheme, rounding))


def qsgd_decode_sum(payloads: jax.Array, n: int, *, bits: int, bucket_size: int,
                    scheme: str) -> jax.Array:
  """payloads: uint8[k, payload_bytes] -> float32[n], the in-order sum of the k decodes."""
  return _call("qcomm_qsgd_decode_sum", (n,), jnp.float32, payloads,
               **_attrs(bits, bucket_size, scheme))


def qsgd_decode_sum_reencode(payloads: jax.Array, seed: jax.Array, n: int, scale: float, *,
                             bits: int, bucket_size: int, scheme: str, rounding: str) -> jax.Array:
  """payloads: uint8[k, P], seed: uint32[2] -> uint8[P] = encode(decode_sum(payloads) * scale).

  One kernel for the middle of the scatter-reduce-allgather allreduce; the bytes are those of
  ``qsgd_decode_sum`` -> ``* float32(scale)`` (skipped where scale == 1) -> ``qsgd_encode``.
  """
  size = wire.qsgd_payload_bytes(n, bits, bucket_size, scheme)
  return _call("qcomm_qsgd_decode_sum_reencode", (size,), jnp.uint8, payloads, seed,
               **_attrs(bits, bucket_size, scheme, rounding, n=np.int64(n), scale=np.float32(scale)))


def summable_encode(x: jax.Array, shared: jax.Array, seed: jax.Array, *, bits: int,
                    bucket_size: int, devices: int, rounding: str) -> jax.Array:
  """x: float32[n], shared: int32[num_buckets], seed: uint32[2] -> uint32[num_words] (the summable
  codec's words for `devices` summed payloads; docs/wire-format.md)."""
  size = wire.summable_words(x.shape[-1], bits, devices)
  return _call("qcomm_summable_encode", (size,), jnp.uint32, x, shared, seed,
               **_attrs(bits, bucket_size, rounding=rounding, devices=np.int32(devices)))


def summable_decode(words: jax.Array, shared: jax.Array, n: int, *, bits: int, bucket_size: int,
                    devices: int, count: int, scale: float) -> jax.Array:
  """words: uint32[num_words] (the sum of `count` payloads), shared: int32[num_buckets] ->
  float32[n], the sum of their decodes times float32(scale)."""
  return _call("qcomm_summable_decode", (n,), jnp.float32, words, shared,
               **_attrs(bits, bucket_size, devices=np.int32(devices), count=np.int32(count),
                        scale=np.float32(scale)))


def _call_leaves(target: str, results, *operands: jax.Array, **attrs):
  """``_call`` for the kernels on a list of leaves (any number of operands or results, one call;
  under vmap, one call per batch element)."""
  return _varying_call(target, results, "sequential", operands, attrs)


def summable_scale_leaves(leaves, *, bucket_size: int) -> jax.Array:
  """float32 leaves -> int32[num_buckets] of their packed buffer (each leaf padded with zeros to
  whole buckets), read in place."""
  nb = wire.leaves_span([x.size for x in leaves], bucket_size) // bucket_size
  return _call_leaves("qcomm_summable_scale_leaves", jax.ShapeDtypeStruct((nb,), jnp.int32),
                      *leaves, bucket_size=np.int32(bucket_size))


def summable_encode_leaves(leaves, shared: jax.Array, seed: jax.Array, *, bits: int,
                           bucket_size: int, devices: int, rounding: str) -> jax.Array:
  """float32 leaves -> the uint32 words of their packed buffer (as ``summable_encode`` of it)."""
  n = wire.leaves_span([x.size for x in leaves], bucket_size)
  size = wire.summable_words(n, bits, devices)
  return _call_leaves("qcomm_summable_encode_leaves", jax.ShapeDtypeStruct((size,), jnp.uint32),
                      shared, seed, *leaves,
                      **_attrs(bits, bucket_size, rounding=rounding, devices=np.int32(devices)))


def _call_into_pieces(target: str, rows: int, size: int, widths, /, *operands, **attrs):
  """``_call_leaves`` of a kernel that writes ``rows`` payloads of ``size`` bytes: uint8[rows,
  size]; with ``widths`` (summing to ``size``), the rows cut along their bytes into pieces of those
  widths, a list of uint8[rows, w], each made of its rows written apart (XLA hands them to an
  all-to-all as they are)."""
  if widths is None:
    return _call_leaves(target, [jax.ShapeDtypeStruct((rows, size), jnp.uint8)], *operands,
                        **attrs)[0]
  out = _call_leaves(target,
                     [jax.ShapeDtypeStruct((1, w), jnp.uint8) for w in widths for _ in range(rows)],
                     *operands, **attrs)
  return [jnp.concatenate(out[q * rows:(q + 1) * rows]) for q in range(len(widths))]


def qsgd_encode_leaves(leaves, seeds: jax.Array, n: int, skip: jax.Array, *, bits: int,
                       bucket_size: int, scheme: str, rounding: str, widths=None):
  """float32 leaves, seeds: uint32[rows, 2], skip: int32[] -> uint8[rows, payload_bytes(n)]:
  ``qsgd_encode`` of each row of n values (a multiple of ``bucket_size``) of the leaves' packed
  buffer (each leaf padded to whole buckets with its last value for maxmin, 0 for norm, as
  ``concat_leaves`` pads it), zeros after the leaves up to rows * n; read in place. Row ``skip``
  (-1: none) is zeros. With ``widths`` (summing to the payload's bytes), the rows in pieces of
  those widths, written in place (``_call_into_pieces``)."""
  rows = seeds.shape[0]
  size = wire.qsgd_payload_bytes(n, bits, bucket_size, scheme)
  return _call_into_pieces("qcomm_qsgd_encode_leaves", rows, size, widths, seeds, skip, *leaves,
                           **_attrs(bits, bucket_size, scheme, rounding, n=np.int64(n),
                                    rows=np.int64(rows)))


def qsgd_decode_sum_reencode_own(blocks, seed: jax.Array, slot: jax.Array, leaves,
                                 row: jax.Array, n: int, scale: float, *, bits: int,
                                 bucket_size: int, scheme: str, rounding: str, rows: int,
                                 widths=None):
  """blocks: the ``rows`` payloads of P bytes each, in pieces along their bytes (in order, each
  piece uint8[rows, w] or ``rows`` uint8[1, w] of its rows; one uint8[rows, P]: the payloads
  whole), seed: uint32[2], slot, row: int32[], float32 leaves -> uint8[P] = encode((v_0 + ... +
  v_{k-1}) * scale), summed in order, v_j the decode of payload j but v_slot row ``row`` (n
  values, a multiple of ``bucket_size``) of the leaves' packed buffer, read in place and exact.
  With ``widths``: the result cut into pieces of those widths (a list of uint8[w])."""
  size = wire.qsgd_payload_bytes(n, bits, bucket_size, scheme)
  out = _call_leaves("qcomm_qsgd_decode_sum_reencode_own",
                     [jax.ShapeDtypeStruct((w,), jnp.uint8) for w in (widths or [size])],
                     seed, slot, row, *blocks, *leaves,
                     **_attrs(bits, bucket_size, scheme, rounding, n=np.int64(n),
                              scale=np.float32(scale), rows=np.int64(rows),
                              pieces=np.int64(len(blocks))))
  return out if widths is not None else out[0]


def qsgd_decode_pieces(blocks, n: int, *, rows: int, bits: int, bucket_size: int,
                       scheme: str) -> jax.Array:
  """blocks: ``rows`` payloads of n values in pieces along their bytes (as
  ``qsgd_decode_sum_reencode_own`` takes them) -> float32[rows, n], each row decoded, read where
  the pieces lie."""
  return _call_leaves("qcomm_qsgd_decode_pieces", jax.ShapeDtypeStruct((rows, n), jnp.float32),
                      *blocks, **_attrs(bits, bucket_size, scheme))


def _chunks_attrs(leaves, devices: int, pre, chunk) -> dict:
  if len(pre) != len(leaves) or len(chunk) != len(leaves):
    raise ValueError(f"pre and chunk must have one entry per leaf ({len(leaves)}), got "
                     f"{len(pre)} and {len(chunk)}")
  return dict(devices=np.int64(devices), pre=np.asarray(pre, np.int64),
              chunk=np.asarray(chunk, np.int64))


def qsgd_chunks_row_bytes(pre, chunk, *, bits: int, bucket_size: int, scheme: str) -> int:
  """Bytes of one row of :func:`qsgd_encode_chunks`' message."""
  total = 0
  for p, c in zip(pre, chunk):
    runs, n = wire.chunk_runs(int(p), int(c), bucket_size)
    total += runs * wire.qsgd_payload_bytes(n, bits, bucket_size, scheme)
  return total


def qsgd_encode_chunks(leaves, seeds: jax.Array, skip: jax.Array, *, devices: int, pre, chunk,
                       bits: int, bucket_size: int, scheme: str, rounding: str, widths=None):
  """float32 leaves, leaf i ``devices * pre[i] * chunk[i]`` values (``pre[i]`` runs of
  ``devices`` chunks; device j's shard: chunk j of every run), seeds: uint32[payloads, 2],
  skip: int32[] -> uint8[devices, W]: row j every leaf's payloads of shard j, leaf by leaf, each
  shard as :func:`jax_qcomm.native.wire.chunk_runs` payloads, payload (i, r, j) encoded with seed
  ``s_i + r * devices + j`` (``s_i`` the payloads of the leaves before i). Read in place; row
  ``skip`` (-1: none) is zeros. With ``widths`` (summing to W), the rows in pieces of those
  widths, written in place (``_call_into_pieces``)."""
  size = qsgd_chunks_row_bytes(pre, chunk, bits=bits, bucket_size=bucket_size, scheme=scheme)
  return _call_into_pieces("qcomm_qsgd_encode_chunks", devices, size, widths, seeds, skip, *leaves,
                           **_attrs(bits, bucket_size, scheme, rounding,
                                    **_chunks_attrs(leaves, devices, pre, chunk)))


def qsgd_encode_differences(news, olds, seeds: jax.Array, shard: jax.Array, *, devices: int, pre,
                            chunk, bits: int, bucket_size: int, scheme: str, rounding: str,
                            widths=None):
  """news: float32[pre[i] * chunk[i]] per leaf, olds: float32[pre[i] * devices * chunk[i]] per
  leaf (``pre[i]`` runs of ``devices`` chunks), seeds: uint32[leaves, 2], shard: int32[] ->
  uint8[1, W]: one payload per leaf (seed i) of ``new[i]`` less shard ``shard`` of ``old[i]``,
  value by value, laid out as :func:`qsgd_encode_chunks` lays a row; read where both lie. With
  ``widths``, in pieces as :func:`qsgd_encode_chunks` writes them."""
  if len(news) != len(olds):
    raise ValueError(f"news and olds must have one entry per leaf, got {len(news)} and "
                     f"{len(olds)}")
  size = qsgd_chunks_row_bytes([1] * len(pre), [int(p) * int(c) for p, c in zip(pre, chunk)],
                               bits=bits, bucket_size=bucket_size, scheme=scheme)
  return _call_into_pieces("qcomm_qsgd_encode_differences", 1, size, widths, seeds, shard, *news,
                           *olds, **_attrs(bits, bucket_size, scheme, rounding,
                                           **_chunks_attrs(olds, devices, pre, chunk)))


def _blocks(message) -> list:
  """A message as the blocks of its pieces: one uint8[rows, W] array, or the pieces' blocks in
  order (each uint8[rows, w], or uint8[1, w] for one row of a piece)."""
  return [message] if isinstance(message, jax.Array) else list(message)


def qsgd_decode_chunks(message, *, rows: int, pre, chunk, bits: int, bucket_size: int,
                       scheme: str) -> list:
  """message: ``rows`` rows of W bytes, each one device's row of :func:`qsgd_encode_chunks` (for
  ``devices == 1``: leaf i its ``pre[i]`` runs of ``chunk[i]`` values), as one uint8[rows, W] or
  the blocks of its pieces (``_blocks``) -> float32[rows, pre[i] * chunk[i]] per leaf: each row's
  decodes, read where the pieces lie and written in place of per-leaf slices."""
  if len(pre) != len(chunk):
    raise ValueError(f"pre and chunk must have one entry per leaf, got {len(pre)} and "
                     f"{len(chunk)}")
  results = [jax.ShapeDtypeStruct((rows, int(p) * int(c)), jnp.float32) for p, c in zip(pre, chunk)]
  return list(_call_leaves("qcomm_qsgd_decode_chunks", results, *_blocks(message),
                           **_attrs(bits, bucket_size, scheme, pre=np.asarray(pre, np.int64),
                                    chunk=np.asarray(chunk, np.int64), rows=np.int64(rows))))


def qsgd_decode_sum_chunks(received, slot: jax.Array, leaves, scale: float, *, devices: int, pre,
                           chunk, bits: int, bucket_size: int,
                           scheme: str) -> tuple[jax.Array, list]:
  """received: ``devices`` rows (row s: device s's row of :func:`qsgd_encode_chunks` for this
  device), one uint8[devices, W] or the blocks of its pieces (``_blocks``), slot: int32[], the
  leaves as ``qsgd_encode_chunks`` takes them -> ``(mark, shards)``: shard i float32[pre[i] *
  chunk[i]] = (v_0 + ... + v_{devices-1}) * scale, summed in order, v_s the decode of row s's
  payloads of leaf i but v_slot (slot -1: none) shard ``slot`` of leaf i, exact; mark a float32
  scalar, 0 where every value of the shards is finite, else NaN. Read where the pieces lie."""
  blocks = _blocks(received)
  results = [jax.ShapeDtypeStruct((), jnp.float32)] + [
      jax.ShapeDtypeStruct((int(p) * int(c),), jnp.float32) for p, c in zip(pre, chunk)]
  out = _call_leaves("qcomm_qsgd_decode_sum_chunks", results, slot, *blocks, *leaves,
                     **_attrs(bits, bucket_size, scheme, scale=np.float32(scale),
                              pieces=np.int64(len(blocks)),
                              **_chunks_attrs(leaves, devices, pre, chunk)))
  return out[0], list(out[1:])


def summable_decode_leaves(words: jax.Array, shared: jax.Array, sizes, *, bits: int,
                           bucket_size: int, devices: int, count: int, scale: float) -> list:
  """The words of a packed buffer -> float32[sizes[i]] per leaf (as ``summable_decode``, padding
  dropped), written in place."""
  results = [jax.ShapeDtypeStruct((int(n),), jnp.float32) for n in sizes]
  return _call_leaves("qcomm_summable_decode_leaves", results, words, shared,
                      **_attrs(bits, bucket_size, devices=np.int32(devices),
                               count=np.int32(count), scale=np.float32(scale)))


def summable_scale(x: jax.Array, *, bucket_size: int) -> jax.Array:
  """x: float32[n] -> int32[num_buckets]: the bits of each bucket's largest |x|."""
  nb = wire.num_buckets(x.shape[-1], bucket_size)
  return _call("qcomm_summable_scale", (nb,), jnp.int32, x, bucket_size=np.int32(bucket_size))
