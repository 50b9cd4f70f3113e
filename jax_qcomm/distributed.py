"""Several JAX processes on CPU: ``jax.distributed`` over gloo, and a global mesh.

Start the processes with the launcher, which sets the environment variables read here::

    python -m jax_qcomm.launch -n 4 --local-devices 2 train.py

and in ``train.py``, before anything touches a JAX backend::

    from jax_qcomm import distributed
    distributed.initialize()                  # reads QCOMM_* from the environment
    mesh = distributed.global_mesh(("data",))  # all devices of all processes

Environment variables (set by :mod:`jax_qcomm.launch`):

* ``QCOMM_COORDINATOR``     ``host:port`` of the coordination service (run by process 0);
* ``QCOMM_NUM_PROCESSES``   number of processes;
* ``QCOMM_PROCESS_ID``      this process's index, 0..n-1;
* ``QCOMM_LOCAL_DEVICES``   host (CPU) devices per process (``jax_num_cpu_devices``);
* ``QCOMM_GLOO_INTERFACE``  network interface gloo binds to (e.g. ``eth0``); by default gloo binds to
  the address of the machine's hostname.

Device ids: across processes, CPU device ids are ``2048 * process_index + k``, so never index
devices by id; :func:`global_mesh` orders them by (process_index, local id) and the mesh position is
the global device index.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

import jax
from jax.sharding import Mesh

from jax_qcomm._checks import check_int

ENV_COORDINATOR = "QCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "QCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "QCOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "QCOMM_LOCAL_DEVICES"
ENV_GLOO_INTERFACE = "QCOMM_GLOO_INTERFACE"

__all__ = ["initialize", "global_mesh", "global_devices", "under_launcher", "process_allgather",
           "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_LOCAL_DEVICES",
           "ENV_GLOO_INTERFACE"]


def under_launcher() -> bool:
  """True if this process was started by :mod:`jax_qcomm.launch` (``QCOMM_NUM_PROCESSES`` set)."""
  return bool(os.environ.get(ENV_NUM_PROCESSES))


def _env_int(name: str, value: int | None, what: str) -> int | None:
  if value is not None:
    return value
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"{what}: environment variable {name} must be an integer, got {text!r}") from None


def _register_gloo_cpu_backend(interface: str | None, hostname: str | None) -> None:
  """Replaces jax's "cpu" backend factory by one whose gloo collectives bind to ``interface``.

  jax's own factory (``xla_bridge.make_cpu_client``) builds the gloo collectives without an
  interface; jaxlib's ``make_gloo_tcp_collectives`` takes one. The factory runs when the first
  backend is created, after ``jax.distributed.initialize``, so it reads the distributed client then.
  """
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  def make_cpu_client_with_interface():
    client = jax_distributed.global_state.client
    if client is None:
      raise RuntimeError("jax_qcomm.distributed: the gloo CPU backend needs jax.distributed to be "
                         "initialised first (call jax_qcomm.distributed.initialize)")
    collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, hostname=hostname,
                                                 interface=interface)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client_with_interface, priority=0,
                                      fail_quietly=False)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None,
               interface: str | None = None, *, hostname: str | None = None,
               initialization_timeout: int = 120, heartbeat_timeout_seconds: int = 30) -> None:
  """Joins this process to a multi-process CPU run: gloo collectives over ``jax.distributed``.

  Must be called before anything initialises a JAX backend (any computation, ``jax.devices()``,
  ``jax.device_put``, ...): it changes the CPU backend's configuration, which JAX reads once when it
  creates the backend. A RuntimeError says so if a backend already exists.

  Arguments left as None come from the environment set by :mod:`jax_qcomm.launch`
  (``QCOMM_COORDINATOR``, ``QCOMM_NUM_PROCESSES``, ``QCOMM_PROCESS_ID``, ``QCOMM_LOCAL_DEVICES``,
  ``QCOMM_GLOO_INTERFACE``).

  Args:
    coordinator_address: ``host:port`` of the coordination service, which process 0 runs.
    num_processes: number of processes.
    process_id: this process's index in 0..num_processes-1.
    local_device_count: host devices in this process (sets ``jax_num_cpu_devices``); None keeps
      JAX's default (one CPU device).
    interface: network interface for gloo's sockets (``"eth0"``, ``"lo"``, ...). By default gloo
      binds to the address of the machine's hostname. Implemented by re-registering JAX's ``"cpu"``
      backend factory with one that passes ``interface`` to jaxlib's ``make_gloo_tcp_collectives``
      (JAX's own factory passes none), which is why this must happen before any backend exists.
    hostname: alternatively, the host name or address gloo binds to (jaxlib's ``hostname``).
    initialization_timeout: seconds to wait for all processes to join.
    heartbeat_timeout_seconds: seconds without heartbeat after which the coordination service
      declares a process dead (the others then fail instead of hanging).
  """
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    raise RuntimeError(
        "jax_qcomm.distributed.initialize() must be called before any JAX backend is initialised "
        "(before any computation, jax.devices(), jax.device_put(), ...): it configures the CPU "
        "backend's gloo collectives and device count, which JAX reads only when it creates the "
        "backend")
  what = "jax_qcomm.distributed.initialize"
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = _env_int(ENV_NUM_PROCESSES, num_processes, what)
  process_id = _env_int(ENV_PROCESS_ID, process_id, what)
  local_device_count = _env_int(ENV_LOCAL_DEVICES, local_device_count, what)
  if interface is None:
    interface = os.environ.get(ENV_GLOO_INTERFACE) or None
  missing = [name for name, value in ((f"coordinator_address ({ENV_COORDINATOR})", coordinator_address),
                                      (f"num_processes ({ENV_NUM_PROCESSES})", num_processes),
                                      (f"process_id ({ENV_PROCESS_ID})", process_id))
             if value is None]
  if missing:
    raise ValueError(f"{what}: {', '.join(missing)} not given and not set in the environment; "
                     "start the processes with `python -m jax_qcomm.launch -n N script.py` or pass "
                     "them explicitly")
  if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
    raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
  check_int("num_processes", num_processes, 1)
  check_int("process_id", process_id, 0)
  if process_id >= num_processes:
    raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
  if local_device_count is not None:
    check_int("local_device_count", local_device_count, 1)
  if interface is not None and (not isinstance(interface, str) or not interface):
    raise ValueError(f"interface must be a network interface name such as 'eth0', got {interface!r}")
  if interface is not None and os.path.isdir("/sys/class/net") and not os.path.exists(
      os.path.join("/sys/class/net", interface)):
    raise ValueError(f"interface {interface!r} does not exist on this machine; available: "
                     f"{sorted(os.listdir('/sys/class/net'))}")

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  if interface is not None or hostname is not None:
    _register_gloo_cpu_backend(interface, hostname)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=int(num_processes), process_id=int(process_id),
                             cluster_detection_method="deactivate",
                             initialization_timeout=initialization_timeout,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def global_devices() -> list[jax.Device]:
  """All devices of all processes ordered by (process_index, local id).

  The position in this list is the global device index; device ids are not (they are
  ``2048 * process_index + k`` across CPU processes).
  """
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_mesh(axis_names: str | Sequence[str] = ("data",),
                shape: Sequence[int] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` over all global devices, ordered by (process_index, local id).

  Args:
    axis_names: one name, or several (e.g. ``("proc", "local")``).
    shape: the mesh shape; default: all devices on one axis, or for two names
      (process_count, local_device_count) -- processes on the first axis, each process's own
      devices on the second (the slow and the fast axis of :class:`jax_qcomm.Hierarchical`).

  The axes are ``Auto`` (``Mesh(devices, names)``), so ``jax.shard_map`` accepts unsharded inputs;
  ``jax.make_mesh`` would make them Explicit.
  """
  if isinstance(axis_names, str):
    axis_names = (axis_names,)
  axis_names = tuple(axis_names)
  devices = global_devices()
  if shape is None:
    if len(axis_names) == 1:
      shape = (len(devices),)
    elif len(axis_names) == 2:
      shape = (jax.process_count(), jax.local_device_count())
    else:
      raise ValueError(f"shape is required for {len(axis_names)} axis names {axis_names}")
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"shape {shape} needs one entry per axis name {axis_names}")
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"shape {shape} has {int(np.prod(shape))} positions but there are "
                     f"{len(devices)} devices ({jax.process_count()} processes x "
                     f"{jax.local_device_count()} local)")
  return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


def process_allgather(tree: Any, tiled: bool = False) -> Any:
  """Numpy copies of a pytree gathered from every process (stacked on a new axis 0, or
  concatenated with ``tiled``): ``jax.experimental.multihost_utils.process_allgather``."""
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=tiled)
