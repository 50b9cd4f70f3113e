"""Every difference between the jax versions jax_qcomm supports (jax >= 0.11), in one place.

Each difference is decided once, at import time, by a feature test named and documented here; the
rest of the package calls the functions below and never looks at jax's version or its private
modules (``jax._src``).

What differs, and what does not:

* **Varying manual axes (vma).** Inside ``jax.shard_map`` every abstract value records the mesh
  axes it varies over. jax 0.11 keeps them in ``ShapedArray.vma``; jax 0.12 moved them to
  ``ShapedArray.mat.varying`` (``mat``: the manual-axis type) and dropped ``vma``. Feature test:
  whether ``jax.core.ShapedArray`` has the ``mat`` attribute (:data:`HAS_MAT`). :func:`vma_of`
  reads the right one; :func:`make_varying` adds axes with ``lax.pcast(..., to="varying")``, which
  both versions have.
* ``jax.typeof`` and ``jax.shard_map`` (top level, not ``jax.experimental``) exist in every
  supported version: no shim, call them directly.
* **CPU collectives bound to a network interface** (gloo on ``eth0`` rather than the hostname's
  address). No jax version has a public way: jax's CPU backend factory builds the gloo collectives
  with the distributed client only. :func:`register_gloo_cpu_backend` replaces that factory through
  the public ``jax.extend.backend.register_backend_factory``, but the factory it registers needs
  three private names (``jax._src``, ``jaxlib._jax``), listed in :data:`GLOO_PRIVATE_NAMES` and
  imported only here, the package's only use of private jax names. tests/test_faults.py checks they exist with the arguments used
  here, so a jax release that moves one fails that test by name, not a benchmark in a netns.
* **The ``jax.distributed`` state** (the coordination client, this process's index and the process
  count, known only after ``jax.distributed.initialize`` when jax's cluster detection chose them).
  ``jax.distributed`` has no public accessor before a backend exists (``jax.process_index()`` would
  create one). :func:`distributed_state` reads the same private ``global_state`` as above.
* **Elastic runs** (a coordination service outside the workers, and a CPU backend rebuilt when a
  restarted process rejoins). ``jax.distributed.initialize`` starts the coordination service in
  process 0, so the death of process 0 ends every process. :func:`start_coordination_service`
  starts it on its own (jaxlib's ``get_distributed_runtime_service``, recoverable), and
  :func:`connect_client` joins a worker to it as jax's own initialize would, minus the service.
  XLA:CPU caches its gloo communicators by device set and rendezvous through coordination-service
  keys of the same name (``cpu:gloo/<device ids>/<rank>``), and builds the CPU topology through
  ``cpu:local_topology`` / ``cpu:global_topology`` keys: a restarted process cannot enter a set it
  was in before (docs/distributed.md has the reproduction). :func:`reset_cpu_backend` drops the
  backend (public ``jax.extend.backend.clear_backends``) and :data:`CPU_BACKEND_KEYS` are the keys
  to delete before every process builds a new one.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
from jax import lax
from jax.extend import backend as jex_backend

#: Feature test, once: jax 0.12 stores the varying manual axes in ``aval.mat.varying``; jax 0.11
#: in ``aval.vma``.
HAS_MAT: bool = hasattr(jax.core.ShapedArray, "mat")


def current_trace() -> Any:
  """The trace being built now (an object that identifies one tracing of a function), or None
  where this jax does not expose it."""
  try:
    from jax._src import core  # noqa: PLC0415
    return core.trace_ctx.trace
  except (ImportError, AttributeError):
    return None


def vma_of(x: Any) -> frozenset:
  """The mesh axes ``x`` (an array, tracer or abstract value) varies over; empty outside
  ``shard_map`` and under ``shard_map(check_vma=False)`` or ``pmap``."""
  aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
  if HAS_MAT:
    mat = getattr(aval, "mat", None)  # abstract values other than arrays (tokens, keys' own) lack it
    return frozenset(mat.varying) if mat is not None else frozenset()
  return frozenset(getattr(aval, "vma", ()))


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """``x`` marked as varying over ``axes`` too (a type change; no data moves).

  Needed where a value's recorded axes are fewer than its true ones: ``ffi_call`` results carry no
  record, and both branches of a ``lax.cond`` must agree on it."""
  missing = tuple(axes - vma_of(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def _same_vma(branches: Sequence[Callable[[], Any]]) -> list[Callable[[Any], Any]]:
  """The branches, each marking every output varying over the union of the axes any branch's
  output varies over (lax.cond / lax.switch need the same types from every branch)."""
  jaxprs = [jax.make_jaxpr(b)() for b in branches]
  want = [frozenset().union(*(vma_of(j.out_avals[i]) for j in jaxprs))
          for i in range(len(jaxprs[0].out_avals))]

  def wrap(branch):
    def run(_):
      leaves, treedef = jax.tree_util.tree_flatten(branch())
      return jax.tree_util.tree_unflatten(treedef, [make_varying(x, w) for x, w in zip(leaves, want)])
    return run

  return [wrap(b) for b in branches]


def cond(pred: jax.Array, branches: Sequence[Callable[[], Any]]) -> Any:
  """``lax.cond(pred, branches[0], branches[1])`` whose branches may differ in vma: every output
  is marked varying over the union of the axes either branch's output varies over."""
  true_fn, false_fn = _same_vma(branches)
  return lax.cond(pred, true_fn, false_fn, None)


def switch(index: jax.Array, branches: Sequence[Callable[[], Any]]) -> Any:
  """``lax.switch(index, branches)`` whose branches may differ in vma (as :func:`cond`)."""
  return lax.switch(index, _same_vma(branches), None)


# ---- gloo bound to a network interface (private jax names, isolated here) -------------------------

#: The private names :func:`register_gloo_cpu_backend` uses, as (module, attribute): jax's CPU client
#: constructor (its ``collectives`` argument overrides the flag-chosen implementation), the
#: ``jax.distributed`` client (``jax.distributed`` exposes no accessor), and jaxlib's gloo
#: constructor (``distributed_client, hostname=None, interface=None``).
GLOO_PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("jax._src.xla_bridge", "make_cpu_client"),
    ("jax._src.distributed", "global_state"),
    ("jaxlib._jax", "make_gloo_tcp_collectives"),
)


def _gloo_private_api() -> tuple[Callable[..., Any], Any, Callable[..., Any]]:
  """(make_cpu_client, distributed global_state, make_gloo_tcp_collectives), or a RuntimeError
  naming the private name this jax version lacks."""
  import importlib

  found = []
  for module, name in GLOO_PRIVATE_NAMES:
    try:
      found.append(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError) as e:
      raise RuntimeError(
          f"jax_qcomm: binding gloo to a network interface needs {module}.{name}, which jax "
          f"{jax.__version__} does not have ({e}); jax_qcomm._compat must be updated for this "
          "jax version (or leave interface/hostname unset: gloo then binds to the hostname's "
          "address)") from e
  return found[0], found[1], found[2]


def gloo_private_api_problems() -> list[str]:
  """What is missing or changed in the private names :func:`register_gloo_cpu_backend` uses
  (empty if all are as expected). For the test that fails loudly when jax moves them."""
  try:
    make_cpu_client, global_state, make_gloo = _gloo_private_api()
  except RuntimeError as e:
    return [str(e)]
  problems = []
  if "collectives" not in inspect.signature(make_cpu_client).parameters:
    problems.append("jax._src.xla_bridge.make_cpu_client has no 'collectives' argument")
  if not hasattr(global_state, "client"):
    problems.append("jax._src.distributed.global_state has no 'client'")
  doc = getattr(make_gloo, "__doc__", "") or ""
  for arg in ("distributed_client", "hostname", "interface"):
    if arg not in doc:
      problems.append(f"jaxlib's make_gloo_tcp_collectives has no {arg!r} argument: {doc[:200]}")
  return problems


def distributed_state() -> tuple[Any, int | None, int | None]:
  """(coordination client or None, this process's index, process count) of ``jax.distributed``,
  without creating a backend. The client answers ``get_live_nodes(process_ids)``."""
  import importlib

  try:
    state = importlib.import_module("jax._src.distributed").global_state
  except (ImportError, AttributeError):
    return None, None, None
  if getattr(state, "client", None) is None:
    return None, None, None
  return state.client, getattr(state, "process_id", None), getattr(state, "num_processes", None)


def coordinator_address() -> str | None:
  """The coordination service's ``host:port`` this process connected to (``jax.distributed``'s
  record of it), or None."""
  import importlib

  try:
    state = importlib.import_module("jax._src.distributed").global_state
  except (ImportError, AttributeError):
    return None
  return getattr(state, "coordinator_address", None)


def distributed_state_problems() -> list[str]:
  """What is missing in the private ``jax.distributed`` state :func:`distributed_state` reads and
  the client method it relies on (empty if all are as expected)."""
  import importlib

  try:
    state = importlib.import_module("jax._src.distributed").global_state
  except (ImportError, AttributeError) as e:
    return [f"jax._src.distributed.global_state is gone ({e})"]
  problems = [f"jax._src.distributed.global_state has no {name!r}"
              for name in ("client", "process_id", "num_processes", "coordinator_address")
              if not hasattr(state, name)]
  try:
    client_type = importlib.import_module("jaxlib._jax").DistributedRuntimeClient
  except (ImportError, AttributeError) as e:
    return problems + [f"jaxlib._jax.DistributedRuntimeClient is gone ({e})"]
  if not hasattr(client_type, "get_live_nodes"):
    problems.append("jaxlib's DistributedRuntimeClient has no get_live_nodes")
  return problems


def register_gloo_cpu_backend(interface: str | None, hostname: str | None) -> None:
  """Makes JAX's ``"cpu"`` backend use gloo collectives bound to ``interface`` (or ``hostname``).

  Registers, through the public ``jax.extend.backend.register_backend_factory``, a factory that
  builds jaxlib's gloo collectives with the interface and hands them to jax's own CPU client
  constructor. The factory runs when the first backend is created, after ``jax.distributed`` has
  connected, so it reads the distributed client then. Must be called before any backend exists.
  """
  make_cpu_client, global_state, make_gloo = _gloo_private_api()

  def make_cpu_client_with_interface():
    client = global_state.client
    if client is None:
      raise RuntimeError("jax_qcomm.tools.distributed: the gloo CPU backend needs jax.distributed to be "
                         "initialised first (call jax_qcomm.tools.distributed.initialize)")
    collectives = make_gloo(distributed_client=client, hostname=hostname, interface=interface)
    return make_cpu_client(collectives=collectives)

  jex_backend.register_backend_factory("cpu", make_cpu_client_with_interface, priority=0,
                                       fail_quietly=False)


#: Coordination-service key directories XLA:CPU writes when it builds a backend and its gloo
#: communicators; deleted (by one process, between two barriers of all) before a backend rebuild.
#: The last one is the topology process 0 writes.
CPU_BACKEND_KEYS = ("cpu:gloo", "cpu:local_topology", "cpu:global_topology")


def _jaxlib_distributed() -> tuple[Any, Any]:
  """(jaxlib's ``_jax`` module, jax's ``distributed.global_state``): private names, used only for
  the elastic mode (a service outside the workers)."""
  import importlib

  try:
    return (importlib.import_module("jaxlib._jax"),
            importlib.import_module("jax._src.distributed").global_state)
  except (ImportError, AttributeError) as e:
    raise RuntimeError(f"jax_qcomm: this jax has no jaxlib._jax / jax._src.distributed ({e}); the "
                       "elastic mode needs them") from e


def start_coordination_service(address: str, num_processes: int, *, heartbeat_timeout: int,
                               shutdown_timeout: int) -> Any:
  """jax's coordination service, recoverable (a lost process does not end the others), listening
  on ``address`` (``[::]:port``). Keep the returned object alive; ``.shutdown()`` stops it."""
  jaxlib_jax, _ = _jaxlib_distributed()
  return jaxlib_jax.get_distributed_runtime_service(
      address, int(num_processes), heartbeat_timeout=int(heartbeat_timeout),
      shutdown_timeout=int(shutdown_timeout), recoverable=True)


def connect_client(coordinator_address: str, process_id: int, num_processes: int, *,
                   initialization_timeout: int, heartbeat_timeout: int,
                   shutdown_timeout: int) -> Any:
  """Joins this process to a coordination service started elsewhere: what
  ``jax.distributed.initialize`` does in a process other than 0 (the client, and jax's record of
  it, which the CPU backend and ``multihost_utils`` read), whatever this process's index."""
  jaxlib_jax, state = _jaxlib_distributed()
  if state.client is not None:
    raise RuntimeError("jax.distributed is already initialised in this process")
  client = jaxlib_jax.get_distributed_runtime_client(
      coordinator_address, int(process_id), init_timeout=int(initialization_timeout),
      shutdown_timeout=int(shutdown_timeout), heartbeat_timeout=int(heartbeat_timeout),
      use_compression=True)
  client.connect()
  state.coordinator_address = coordinator_address
  state.process_id = int(process_id)
  state.num_processes = int(num_processes)
  state.client = client
  return client


def reset_cpu_backend() -> None:
  """Drops every backend and jax's compilation caches (``jax.extend.backend.clear_backends``):
  arrays made before are invalid; the next use builds a new CPU client, with new gloo
  communicators."""
  jex_backend.clear_backends()


def cache_compiled_programs_per_process(process_id: int) -> str | None:
  """Keeps this process's compiled programs in jax's persistent compilation cache, so that they
  outlive :func:`reset_cpu_backend` and a restart of the process; returns the directory (None if
  the user turned jax's cache off, ``jax_enable_compilation_cache=False``).

  The directory is ``<base>/process-<process_id>``: ``<base>`` is ``jax_compilation_cache_dir``
  if the user set one, else ``$XDG_CACHE_HOME/jax_qcomm/compilation`` (``~/.cache`` without it).
  Entries are cached whatever their compile time (``jax_persistent_cache_min_compile_time_secs``
  0, unless the user changed it from jax's default). jax writes entries from process 0 only
  (``jax._src.compiler._cache_write``, private): each process here writes its own directory.
  """
  import os  # noqa: PLC0415
  import warnings  # noqa: PLC0415

  from jax._src import compilation_cache, compiler  # noqa: PLC0415

  if not jax.config.jax_enable_compilation_cache:
    return None
  base = jax.config.jax_compilation_cache_dir or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_qcomm",
      "compilation")
  if os.path.basename(base) == f"process-{process_id}":
    base = os.path.dirname(base)  # initialised before in this process
  directory = os.path.join(base, f"process-{int(process_id)}")
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # jax's default
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

  def write(cache_key, compile_time_secs, module_name, backend, executable):
    if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
      return
    try:
      compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                int(compile_time_secs))
    except Exception as e:  # noqa: BLE001  (as jax's own writer: a failed write is a warning)
      warnings.warn(f"jax_qcomm: writing the compilation cache entry of {module_name!r} to "
                    f"{directory}: {type(e).__name__}: {e}")

  compiler._cache_write = write
  return directory
