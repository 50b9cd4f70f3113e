"""jax_qcomm: compressed gradient collectives for JAX.

QSGD codecs as XLA FFI kernels (C++ on CPU, CUDA on NVIDIA GPUs) with a pure-JAX reference of the
same wire format, and the collectives and optax wrapper built from them.
"""

from jax_qcomm import _ffi
from jax_qcomm.codecs import QSGD, Cast, Codec, NoCompression

_ffi.register()

__all__ = ["QSGD", "Cast", "Codec", "NoCompression"]
__version__ = "0.1.0"
