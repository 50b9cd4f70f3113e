"""Benchmarks of jax_qcomm, run as ``python -m jax_qcomm.bench <subcommand> ...``.

Subcommands:

* ``codec`` -- encode, decode and decode-and-sum throughput of the QSGD codec, FFI kernels
  against the pure-JAX reference (:mod:`jax_qcomm.bench.codec`).

Each subcommand prints a table and writes a JSON file of rows plus the metadata of the machine and
run (:mod:`jax_qcomm.bench._timing`). This package imports nothing heavy at import time, so that
the command line can re-execute the interpreter (see :func:`_timing.ensure_malloc_env`) early.
"""
