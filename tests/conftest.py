"""Shared test setup: 8 host CPU devices, a compilation cache, the `gpu` marker, small fixtures.

The device count has to be fixed before JAX initialises a backend, i.e. before any test module
runs an array operation; pytest imports this file first. `jax_num_cpu_devices` (JAX >= 0.4.38) is
used rather than exporting XLA_FLAGS so that subprocesses started by tests (the multi-process
workers) do not inherit the flag; on older JAX the flag is the fallback.

JAX's persistent compilation cache points at a directory made for this pytest session (and
removed after it), so a program the suite compiles again (the trainer's runs of one config in the
resume tests: XLA CPU takes ~20 s to compile a small flax model's initialiser here) is compiled
once. Every run starts cold: nothing is carried between runs, and worker processes (which start
their own interpreters) do not use it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib

NUM_HOST_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={NUM_HOST_DEVICES}"

import jax  # noqa: E402  (the config below must run right after the import)

try:
  jax.config.update("jax_num_cpu_devices", NUM_HOST_DEVICES)
except AttributeError:  # pragma: no cover - JAX without the option: fall back to the XLA flag
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

_CACHE_DIR = tempfile.mkdtemp(prefix="qcomm-test-jax-cache-")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _cuda_available() -> bool:
  try:
    from jax_qcomm.native import _ffi
    return _ffi.has_cuda_kernels() and any(d.platform == "gpu" for d in jax.devices())
  except Exception:  # pragma: no cover - no GPU backend at all
    return False


#: The files that take longest (minutes: trainer compiles, notebooks, process launches), run first;
#: the elastic ones, which mostly wait on their processes, first of all, beside the compiles.
#: scripts/test.sh runs the suite on two pytest-xdist workers, a file at a time (--dist loadfile);
#: handing out the longest files first lets the two finish together instead of one worker starting
#: test_train.py when the other is nearly done. Only the order changes; every test still runs.
HEAVY_FIRST = ("test_elastic_sync.py", "test_train.py", "test_elastic.py", "test_lm.py",
               "test_multiprocess.py", "test_notebooks.py", "test_faults.py", "test_docs.py",
               "test_integration.py")


def pytest_collection_modifyitems(config, items):
  """Orders the heaviest files first (HEAVY_FIRST); skips tests marked `gpu` where no GPU (or no
  CUDA module) is available."""
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
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
