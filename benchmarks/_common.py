"""Timing and run-metadata helpers shared by the benchmarks of this package.

* :func:`median_time`, :class:`Timing`, :func:`gc_paused` -- warm up a jitted function, then time
  ``repeats`` calls (each one waited for with ``block_until_ready``) and keep the median, min and
  max: one implementation, in :mod:`training.timing` (the example trainer times its sync overhead
  with it; it never imports the benchmarks), re-exported here.
* :func:`ensure_malloc_env` / :func:`malloc_metadata` -- the glibc malloc settings of the run.
  XLA CPU allocates a fresh output buffer per call, and glibc serves allocations above its mmap
  threshold (at most 32 MB by default) with fresh mmap pages, so without tuning every call on a
  large array pays for page faults on its whole output. The variables below keep such buffers on
  the heap; glibc reads them once at process start, hence the re-exec. (Why not also one
  arena: see the note below :data:`MALLOC_ENV`.)
* :func:`run_metadata`, :func:`format_table`, :func:`write_json` -- reporting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import socket
import sys
import time
from typing import Any, Sequence

import numpy as np

import jax
import jaxlib
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_qcomm
from jax_qcomm.native import _ffi
from jax_qcomm.tools import distributed
from jax_qcomm.tools import launch

from benchmarks._machine import cpu_model
from jax_qcomm.tools import malloc as malloc_tools
from jax_qcomm.tools.launch import ENV_LAUNCH_COMMAND
from training.timing import Timing, gc_paused, median_time  # noqa: F401  (re-exported)

#: glibc malloc tuning applied by re-exec: no mmap below 4 GiB, no trimming of the heap below 16 GiB.
MALLOC_ENV = {k: v for k, v in launch.MALLOC_REUSE_ENV.items() if k != "MALLOC_ARENA_MAX"}
# MALLOC_ARENA_MAX is not set here: threads other than the main one allocate from secondary arenas
# whose heaps hold at most 64 MiB, so larger buffers allocated there (25.6M float32 is 100 MB) are
# fresh mmaps whatever the threshold (50k page faults per 25.6M allreduce). The processes of
# jax_qcomm.tools.launch (and so the simulated cluster) run with all of launch.MALLOC_REUSE_ENV, its
# default; a single-process benchmark keeps glibc's arenas unless the environment sets it (one
# arena costs multi-threaded matmuls ~10% in lock contention).
#: Set in the environment of the re-executed process, so that it can tell how the variables came.
_REEXEC_MARKER = "JAX_QCOMM_BENCH_MALLOC_REEXEC"


# -- glibc malloc settings --------------------------------------------------------------------------

def ensure_malloc_env(raw: bool) -> None:
  """Re-executes this interpreter with :data:`MALLOC_ENV` set, unless both variables are already
  set or ``raw`` is true. Does not return when it re-executes.

  Only for a process started as a program (``python -m benchmarks``): the new process runs
  ``sys.orig_argv``, the original command line.
  """
  if raw or all(name in os.environ for name in MALLOC_ENV):
    return
  env = dict(os.environ)
  for name, value in MALLOC_ENV.items():
    env.setdefault(name, value)
  env[_REEXEC_MARKER] = "1"
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def malloc_metadata() -> dict[str, Any]:
  """The malloc mode of this process: ``tuned`` (:data:`MALLOC_ENV`), ``raw`` (glibc defaults) or
  ``custom`` (other values); where the variables came from; and every ``MALLOC_*`` variable (and
  ``GLIBC_TUNABLES``) of the environment."""
  values = {name: os.environ.get(name) for name in MALLOC_ENV}
  if all(v is None for v in values.values()):
    mode, source = "raw", None
  else:
    mode = "tuned" if values == MALLOC_ENV else "custom"
    source = "re-exec" if os.environ.get(_REEXEC_MARKER) == "1" else "environment"
  env = {k: v for k, v in sorted(os.environ.items())
         if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}
  # What jax_qcomm.tools.distributed.initialize set with mallopt (tools.malloc), whatever the
  # environment: "set" per parameter it applied.
  mallopt = dict(malloc_tools.applied)
  if mode == "raw" and mallopt and all(v == "set" for v in mallopt.values()):
    mode, source = "mallopt", "initialize"
  return dict(mode=mode, source=source, env=env, mallopt=mallopt)


def malloc_note(meta: dict[str, Any]) -> str:
  """One line saying what the malloc mode of :func:`malloc_metadata` means for the numbers."""
  settings = " ".join(f"{k}={v}" for k, v in meta["env"].items())
  if meta["mode"] == "mallopt":
    return ("malloc: reuse set by jax_qcomm.tools.distributed.initialize with mallopt (one arena, "
            "mmap and trim thresholds of 2 GiB; no MALLOC_* variables)")
  if meta["mode"] == "raw":
    return ("malloc: raw glibc defaults (--raw-malloc): outputs above the mmap threshold (<= 32 MB) "
            "page-fault on every call, which can dominate large sizes")
  how = "re-executed with" if meta["source"] == "re-exec" else "from the environment:"
  return (f"malloc: {meta['mode']} ({how} {settings}): output buffers reuse heap pages instead of "
          "fresh mmaps; pass --raw-malloc for glibc defaults")


# -- run metadata and reporting --------------------------------------------------------------------

def run_metadata(command: Sequence[str]) -> dict[str, Any]:
  """Date, host, CPU, thread counts, versions, backend, kernel ISA, command line and malloc mode."""
  try:
    affinity = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # pragma: no cover - not Linux
    affinity = None
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      hostname=socket.gethostname(),
      cpu_model=cpu_model(),
      nproc=os.cpu_count(),
      cpus_available=affinity,
      python=platform.python_version(),
      jax_version=jax.__version__,
      jaxlib_version=jaxlib.__version__,
      jax_qcomm_version=jax_qcomm.__version__,
      backend=jax.default_backend(),
      devices=[str(d) for d in jax.devices()],
      cpu_isa=_ffi.cpu_isa(),
      has_cuda_kernels=_ffi.has_cuda_kernels(),
      xla_flags=os.environ.get("XLA_FLAGS"),
      command=shlex.join(command),
      malloc=malloc_metadata(),
  )


def machine_line(meta: dict[str, Any], *, isa: bool = False) -> str:
  """Where a report's numbers come from, from :func:`run_metadata`: ``cpu  <CPU model>  nproc=N
  [isa=...]  jax <version>`` (the kernels' ISA with ``isa``)."""
  parts = [meta["backend"], meta["cpu_model"], f"nproc={meta['nproc']}"]
  parts += [f"isa={meta['cpu_isa']}"] if isa else []
  return "  ".join(parts + [f"jax {meta['jax_version']}"])


def times_line(cfg: dict[str, Any]) -> str:
  """``times: median (min, max) of R runs after W warmup runs`` of a report's footer."""
  return f"times: median (min, max) of {cfg['repeats']} runs after {cfg['warmup']} warmup runs"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 align: str | None = None) -> str:
  """A plain-text table; ``align`` has one ``l`` or ``r`` per column (default: all right)."""
  align = align or "r" * len(headers)
  if len(align) != len(headers):
    raise ValueError(f"align needs {len(headers)} letters, got {align!r}")
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

  def line(r: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                     for c, w, a in zip(r, widths, align)).rstrip()

  return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def write_json(path: str | os.PathLike, data: Any) -> pathlib.Path:
  """Writes data as indented JSON, creating the parent directories; returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
  return path


# -- shared by the JAX benchmarks -----------------------------------------------------------------

#: Host devices of a single-process run when ``--devices`` is not given.
DEFAULT_DEVICES = 4
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str) -> int:
  """An element count: ``25000000``, ``25_000_000``, ``2.5e7`` or ``25M`` (k, M, G: powers of 10)."""
  match = re.fullmatch(r"([0-9._eE+]+)([kKmMgG]?)", text.strip())
  try:
    if match is None:
      raise ValueError
    value = float(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2).lower()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"not an element count: {text!r}") from None
  if value < 1 or value != int(value):
    raise argparse.ArgumentTypeError(f"size must be a positive integer, got {text!r}")
  return int(value)


def int_list(text: str) -> list[int]:
  """argparse type: ``"1,2,4"`` (or space-separated) -> [1, 2, 4], each >= 1."""
  try:
    values = [int(v) for v in text.replace(",", " ").split()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def init_devices(devices: int | None) -> None:
  """Multi-process (under the launcher) or single-process device setup; before any backend."""
  if devices is not None and devices < 1:
    raise SystemExit(f"--devices must be >= 1, got {devices}")
  if distributed.under_launcher():
    distributed.initialize(local_device_count=devices)
  else:
    jax.config.update("jax_num_cpu_devices", DEFAULT_DEVICES if devices is None else devices)


def mesh_and_metadata(benchmark: str, command: Sequence[str]):
  """The one-axis ``data`` mesh over every device of every process, and the run's metadata
  (:func:`run_metadata` plus the process layout; the launcher's command line when started
  by :mod:`jax_qcomm.tools.launch`). Shared by the benchmarks that run over processes."""
  mesh = distributed.global_mesh(("data",))
  meta = run_metadata(command)
  if distributed.under_launcher() and os.environ.get(ENV_LAUNCH_COMMAND):
    meta["command"] = os.environ[ENV_LAUNCH_COMMAND]
  meta.update(benchmark=benchmark, num_devices=mesh.devices.size,
              num_processes=jax.process_count(), local_devices=jax.local_device_count(),
              launcher=distributed.under_launcher(),
              gloo_interface=os.environ.get(distributed.ENV_GLOO_INTERFACE))
  meta["devices"] = [str(dev) for dev in distributed.global_devices()]
  return mesh, meta


def global_input(mesh, n: int):
  """float32[D, n], row g (on device g) normal with a device-dependent seed."""
  d = mesh.devices.size

  def rows(idx):
    return np.stack([np.random.default_rng([7, g]).standard_normal(n, dtype=np.float32)
                     for g in range(*idx[0].indices(d))])

  return jax.make_array_from_callback((d, n), NamedSharding(mesh, P("data")), rows)


def collective_timing(t: Timing) -> Timing:
  """Across processes: call i takes the slowest process's time of call i."""
  if jax.process_count() == 1:
    return t

  all_times = np.asarray(distributed.process_allgather(np.asarray(t.times, np.float64)))
  return Timing(tuple(float(v) for v in all_times.max(axis=0)))


def time_step_calls(step, params, state, *args, steps: int, warmup: int = 3):
  """Calls ``params, state, *rest = step(params, state, *args)`` ``warmup + steps`` times, each
  waited for; returns ``(seconds of the last `steps` calls, params, state, rest)`` (a runner's
  step, timed as its users call it: one jitted call after another)."""
  import jax  # noqa: PLC0415 (the torch peers import this module without jax)
  times, rest = [], ()
  for i in range(steps + warmup):
    t0 = time.perf_counter()
    params, state, *rest = step(params, state, *args)
    jax.block_until_ready((params, state, rest))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return times, params, state, rest


def log(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, file=sys.stderr, flush=True)
