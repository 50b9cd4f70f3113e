"""Benchmarks of jax_qcomm, run as ``python -m benchmarks <subcommand> ...`` from the repository
root.

Tooling, not library: this package sits beside ``jax_qcomm/`` (like ``training/``), is not in the
wheel, and ``import jax_qcomm`` never imports it. It imports the library; the library never imports
it.

Subcommands (registry in :mod:`benchmarks._cli`, shared helpers in :mod:`benchmarks._common`):
``codec`` (codec throughput, FFI kernels against the pure-JAX reference), ``allreduce`` (allreduce
time, busbw, algbw per codec), ``step`` (a data-parallel training step: Ts, Tc, eta, beside the cost
model), ``partial`` (fp32 psum of N/gamma values), ``patterns`` (uint8 rows moved by all_to_all,
ppermute rounds, all_gather and shifts, against the link floor), and ``cluster`` (any of them on
the simulated cluster of :mod:`jax_qcomm.tools.cluster`). Each prints a table and writes a JSON of
rows plus the metadata of the machine and run. ``python -m benchmarks.report`` makes markdown
tables from that JSON, ``python -m benchmarks.model`` checks the cost model against it, and
``python -m benchmarks.demo`` is a short tour of the library.

The command line may re-execute the interpreter with glibc's malloc tuned
(:func:`_common.ensure_malloc_env`) before any JAX work.
"""
