"""Shared test setup: 8 host CPU devices, the `gpu` marker, small fixtures.

The device count has to be fixed before JAX initialises a backend, i.e. before any test module
runs an array operation; pytest imports this file first. `jax_num_cpu_devices` (JAX >= 0.4.38) is
used rather than exporting XLA_FLAGS so that subprocesses started by tests (the multi-process
workers) do not inherit the flag; on older JAX the flag is the fallback.
"""

from __future__ import annotations

import os
import zlib

NUM_HOST_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={NUM_HOST_DEVICES}"

import jax  # noqa: E402  (the config below must run right after the import)

try:
  jax.config.update("jax_num_cpu_devices", NUM_HOST_DEVICES)
except AttributeError:  # pragma: no cover - JAX without the option: fall back to the XLA flag
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _cuda_available() -> bool:
  try:
    from jax_qcomm import _ffi
    return _ffi.has_cuda_kernels() and any(d.platform == "gpu" for d in jax.devices())
  except Exception:  # pragma: no cover - no GPU backend at all
    return False


def pytest_collection_modifyitems(config, items):
  """Skips tests marked `gpu` where no GPU (or no CUDA module) is available."""
  if not any(item.get_closest_marker("gpu") for item in items):
    return
  if _cuda_available():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU with the CUDA module built")
  for item in items:
    if item.get_closest_marker("gpu"):
      item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_devices():
  """The 8 host CPU devices."""
  devs = jax.devices("cpu")
  assert len(devs) >= NUM_HOST_DEVICES, (
      f"expected {NUM_HOST_DEVICES} host CPU devices, got {len(devs)}: the device count must be "
      "set before JAX initialises its backends")
  return devs[:NUM_HOST_DEVICES]


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's node id (stable across runs and orderings)."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
