"""The wire format and who produces it: the byte layout (:mod:`.wire`), the pure-JAX reference
(:mod:`._reference`), the binding of the compiled C++/CUDA kernels as XLA FFI targets
(:mod:`._ffi`) and their known-answer test (:mod:`._selftest`).

The lowest layer of the library: it imports nothing of the package but ``_checks`` and
``_compat``. The codecs call into it.
"""
