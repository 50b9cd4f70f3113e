"""Codecs: how an array is turned into bytes on the wire and back.

Every codec maps an array of any shape to one flat ``uint8`` payload (``encode``), back to an
array (``decode``), and sums several payloads in float32 (``decode_sum``, the middle of a
compressed allreduce). Payload layouts are specified in docs/wire-format.md.

============  ===================================================================================
module        contents
============  ===================================================================================
``base``      :class:`Codec` (the interface and the reduction protocol; its docstring says what a
              codec must write, may override and never touches) and the helpers the codecs share
``bucketed``  ``_Bucketed`` (bucket padding, key, kernel or reference) and ``_SummedFields`` (one
              ``pmax`` and one ``psum`` of summable words)
``qsgd``      :class:`QSGD` -- per-bucket quantisation to 1..8 bits with stochastic or nearest
              rounding; the C++/CUDA FFI kernels and a pure-JAX reference of one format
``cast``      :class:`Cast` -- bfloat16 / float16 bits on the wire, float32 accumulation;
              :class:`NoCompression` -- float32 bytes (collectives use plain ``psum`` for it)
``summable``  :class:`Summable` -- levels with a scale shared by all devices, packed into uint32
              words that XLA's own all-reduce sums (C++ kernel on CPU, pure JAX elsewhere)
``wire16``    :class:`Wire16` -- 16-bit fixed-point fields summed as integers (CPU), the bf16
              cast elsewhere
``auto``      :class:`Auto` -- QSGD or Summable, whichever the transport and the device count
              make faster; :func:`codec_for_bits`, :func:`default_bucket`
``topk``      :class:`TopK` -- the largest values of every chunk, quantised, with their
              positions; reduced by an all-gather of the payloads
``powersgd``  :class:`PowerSGD` -- a rank-r approximation of every matrix-shaped leaf, two
              all-reduces of its factors, warm-started from the last reduction (codec state)
============  ===================================================================================

Every name is importable from ``jax_qcomm.codecs`` itself.
"""

# The package's names, private ones included: other modules import them from here.
from jax_qcomm.codecs.base import (  # noqa: F401
    COLLECTIVES, DEFAULT_COMM_BUCKET, FLOAT_DTYPES, IMPLS, Codec, Shape, _check_float,
    _check_out_dtype, _check_payload, _check_traffic, _pad_to, _ring, _sum_in_order, abs_max,
    bounded_mark, concat_leaves, is_float_dtype, nonfinite_mark, reduce_packed, seed_words,
    split_leaves)
from jax_qcomm.codecs.bucketed import _Bucketed, _SummedFields  # noqa: F401
from jax_qcomm.codecs.qsgd import QSGD
from jax_qcomm.codecs.cast import Cast, NoCompression
from jax_qcomm.codecs.summable import Summable
from jax_qcomm.codecs.wire16 import (  # noqa: F401
    _BF16, _MIN_LEVELS_3, _RADIX, Wire16, _fixed16_here, _levels)
from jax_qcomm.codecs.auto import Auto, codec_for_bits, default_bucket
from jax_qcomm.codecs.topk import TopK
from jax_qcomm.codecs.powersgd import PowerSGD

__all__ = [
    "COLLECTIVES", "DEFAULT_COMM_BUCKET", "FLOAT_DTYPES", "IMPLS", "Shape",
    "Codec", "QSGD", "Cast", "NoCompression", "Summable", "Wire16", "Auto", "TopK", "PowerSGD",
    "codec_for_bits", "default_bucket", "concat_leaves", "split_leaves", "reduce_packed",
    "is_float_dtype", "seed_words", "nonfinite_mark", "bounded_mark", "abs_max",
]
