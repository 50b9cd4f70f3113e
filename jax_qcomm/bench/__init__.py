"""Benchmarks of jax_qcomm, run as ``python -m jax_qcomm.bench <subcommand> ...``.

Subcommands:

* ``codec`` -- encode, decode and decode-and-sum throughput of the QSGD codec, FFI kernels
  against the pure-JAX reference; on a GPU also against the copy bandwidth
  (:mod:`jax_qcomm.bench.codec`).
* ``allreduce`` -- allreduce time, busbw and algbw of every codec over local devices or processes
  (:mod:`jax_qcomm.bench.allreduce`).
* ``step`` -- an end-to-end data-parallel training step: Ts, Tc and eta per codec and accumulation,
  beside the cost model (:mod:`jax_qcomm.bench.step`).
* ``partial`` -- fp32 psum of N/gamma values: where bandwidth stops being the bottleneck
  (:mod:`jax_qcomm.bench.partial`).
* ``patterns`` -- the same uint8 rows moved by all_to_all, ppermute rounds, all_gather and single
  ppermute shifts, against the link floor (:mod:`jax_qcomm.bench.patterns`).
* ``cluster`` -- runs any of the above on a simulated bandwidth-limited cluster of network
  namespaces (:mod:`jax_qcomm.bench.cluster`).

Each subcommand prints a table and writes a JSON file of rows plus the metadata of the machine and
run (:mod:`jax_qcomm.bench._timing`). This package imports nothing heavy at import time, so that
the command line can re-execute the interpreter (see :func:`_timing.ensure_malloc_env`) early.
"""
