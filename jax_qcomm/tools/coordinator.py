"""jax's coordination service as a process of its own, for elastic runs.

    python -m jax_qcomm.tools.coordinator -n 3 --port 47600 [--heartbeat-timeout 30]

In an ordinary ``jax.distributed`` run, process 0 hosts the coordination service, so its death
ends every process. For an elastic run the service runs apart from the workers (here, or inside
``python -m jax_qcomm.tools.launch --elastic``) in jax's recoverability mode, and every worker
joins it as a client (``jax_qcomm.tools.distributed.initialize(elastic=True)``, or
``QCOMM_ELASTIC=1``). A worker restarted by any supervisor (SLURM, Kubernetes, systemd) with the
same ``QCOMM_PROCESS_ID`` and ``QCOMM_COORDINATOR`` rejoins the same way. Runs until SIGTERM or
SIGINT (Ctrl-C).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Sequence

from jax_qcomm import _compat
from jax_qcomm.tools.distributed import Timeouts


def start(port: int, num_processes: int, *, heartbeat_timeout: int | None = None,
          shutdown_timeout: int | None = None, bind: str = "[::]") -> Any:
  """Starts the service on ``bind:port`` for ``num_processes`` workers (timeouts in seconds;
  default: :class:`jax_qcomm.tools.distributed.Timeouts`' heartbeat and shutdown, or their
  ``QCOMM_*`` variables). Returns the service; ``.shutdown()`` stops it."""
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
  if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
    raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
  timeouts = Timeouts.from_env(heartbeat=heartbeat_timeout, shutdown=shutdown_timeout)
  return _compat.start_coordination_service(f"{bind}:{port}", num_processes,
                                            heartbeat_timeout=timeouts.heartbeat,
                                            shutdown_timeout=timeouts.shutdown)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_qcomm.tools.coordinator",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, required=True, help="worker count")
  parser.add_argument("--port", type=int, required=True, help="port to listen on")
  parser.add_argument("--bind", default="[::]", help="address to listen on (default: all)")
  parser.add_argument("--heartbeat-timeout", type=int, default=None,
                      help="seconds without heartbeat before a worker is declared lost")
  args = parser.parse_args(argv)
  try:
    service = start(args.port, args.num_processes, heartbeat_timeout=args.heartbeat_timeout,
                    bind=args.bind)
  except ValueError as e:
    parser.error(str(e))
  done = threading.Event()
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: done.set())
  print(f"coordination service for {args.num_processes} workers on {args.bind}:{args.port}",
        flush=True)
  done.wait()
  service.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
