"""Benchmarks and tools of jax_qcomm, run as ``python -m benchmarks <subcommand> ...`` from the
repository root.

Tooling, not library: this package sits beside ``jax_qcomm/`` (like ``training/``), is not in the
wheel, and ``import jax_qcomm`` never imports it. It imports the library; the library never imports
it. The node processes of ``cluster`` run ``python -m benchmarks`` in the same working directory,
so run it from the repository root.

Subcommands:

* ``codec`` -- encode, decode and decode-and-sum throughput of the QSGD codec, FFI kernels
  against the pure-JAX reference; on a GPU also against the copy bandwidth
  (:mod:`benchmarks.codec`).
* ``allreduce`` -- allreduce time, busbw and algbw of every codec over local devices or processes
  (:mod:`benchmarks.allreduce`).
* ``step`` -- an end-to-end data-parallel training step: Ts, Tc and eta per codec and accumulation,
  beside the cost model (:mod:`benchmarks.step`).
* ``partial`` -- fp32 psum of N/gamma values: where bandwidth stops being the bottleneck
  (:mod:`benchmarks.partial`).
* ``patterns`` -- the same uint8 rows moved by all_to_all, ppermute rounds, all_gather and single
  ppermute shifts, against the link floor (:mod:`benchmarks.patterns`).
* ``cluster`` -- runs any of the above on a simulated bandwidth-limited cluster of network
  namespaces (:mod:`benchmarks.cluster`).

Each subcommand prints a table and writes a JSON file of rows plus the metadata of the machine and
run. Shared helpers (timing, metadata, tables, argument types, device setup) live in
:mod:`benchmarks._common`, the registry of subcommands in :mod:`benchmarks._cli`.

``python -m benchmarks.demo`` is a short tour of the library (codecs, every allreduce, an MLP
trained with ``qcomm.sync`` at several bit widths).

The command line parses its arguments, then may re-execute the interpreter with glibc's malloc
tuned (:func:`_common.ensure_malloc_env`) before any JAX work; the modules import jax at the top,
so the first process's import is wasted (a second or two) in exchange for a plain import graph.
"""
