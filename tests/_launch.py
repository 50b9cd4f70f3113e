"""The multi-process tests' launcher: ``tests/<worker>`` as several JAX processes under
``python -m jax_qcomm.tools.launch``."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_workers(worker: str, *args: str, processes: int = 2, local_devices: int = 1,
                   timeout: int = 240) -> subprocess.CompletedProcess:
  """Runs ``tests/<worker>`` as ``processes`` JAX processes of ``local_devices`` host devices each
  (from the repository root, without the test session's XLA_FLAGS) and asserts that every one
  exited 0; returns the completed launcher."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", "-n", str(processes),
                         "--local-devices", str(local_devices), "--timeout", str(timeout),
                         os.path.join(REPO, "tests", worker), *args],
                        env=env, capture_output=True, text=True, timeout=timeout + 60, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return proc
