"""How long the elastic runners' transfer of the state to restarted processes takes, by the number
of pieces it is cut into (``jax_qcomm.runners.transfer.PIPELINE_PIECES``), on the simulated
cluster the goodput harness uses (3 nodes, 10 Mbit/s links).

    python scripts/relay_pieces.py run      # as root: notebooks/data/relay_pieces/relay.json
    python scripts/relay_pieces.py table    # its table (markdown)

Each configuration is the runners' own relay program (``transfer.relay``): node 0 sends a buffer
of the elastic state's size (1.45 MB: per-step sync's parameters and Adam state on the
``lm_bytes`` model; 1.93 MB: diloco's) to node 1, or down the chain 0 -> 1 -> 2. The time is that
of the last receiver, from the call to its result (compiled beforehand): the median of ``--repeat``
calls on communicators in use ("warm"), and of two first calls after a CPU backend rebuild
("cold", the admitting round's case: new gloo communicators).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from elastic_goodput import _cpu  # this directory: the harness whose cluster this measures

OUT = os.path.join(os.path.dirname(__file__), "..", "notebooks", "data", "relay_pieces")
SIZES_MB = (1.45, 1.93)
CONFIGS = [((0, 1), 1), ((0, 1), 4)] + [((0, 1, 2), p) for p in (1, 2, 4, 8, 16, 32)]


def node(out: str, repeat: int) -> None:
  """The program of every node (under ``jax_qcomm.tools.cluster``)."""
  from jax_qcomm.tools import distributed

  distributed.initialize()
  import numpy as np
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import PartitionSpec as P
  from jax_qcomm import _compat
  from jax_qcomm.runners import transfer

  me, client = jax.process_index(), _compat.distributed_state()[0]

  def call(chain, pieces, words):
    mesh = distributed.global_mesh(("node",))
    rows = multihost_utils.host_local_array_to_global_array(
        np.full((1, words), me, np.uint32), mesh, P("node"))
    program = transfer.relay(mesh, "node", chain, pieces).lower(rows).compile()
    return lambda: jax.block_until_ready(program(rows))

  def last_receiver(seconds: float) -> float:  # every process's time: the largest
    return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))

  def timed(run) -> float:
    multihost_utils.sync_global_devices("relay_pieces")
    t = time.perf_counter()
    run()
    return last_receiver(time.perf_counter() - t)

  rows = []
  for size in SIZES_MB:
    words = int(size * 1e6) // 4
    for chain, pieces in CONFIGS:
      run = call(chain, pieces, words)
      warm = [timed(run) for _ in range(repeat)]
      cold = []
      for trial in range(2):
        _compat.reset_cpu_backend()
        client.wait_at_barrier(f"relay_pieces/{size}/{chain}/{pieces}/{trial}/a", 60_000)
        if me == 0:
          for name in _compat.CPU_BACKEND_KEYS:
            client.key_value_delete(name)
        client.wait_at_barrier(f"relay_pieces/{size}/{chain}/{pieces}/{trial}/b", 60_000)
        fresh = call(chain, pieces, words)
        t = time.perf_counter()
        fresh()  # the first collective on the new communicators
        cold.append(last_receiver(time.perf_counter() - t))
      rows.append({"mb": size, "receivers": len(chain) - 1, "pieces": pieces,
                   "warm_s": statistics.median(warm), "cold_s": statistics.median(cold),
                   "warm_all_s": warm, "cold_all_s": cold})
      if me == 0:
        print(json.dumps(rows[-1]), flush=True)
  if me == 0:
    with open(out, "w") as f:
      json.dump({"rows": rows, "repeat": repeat, "jax": jax.__version__}, f, indent=1)


def run(repeat: int) -> None:
  os.makedirs(OUT, exist_ok=True)
  path = os.path.join(OUT, "relay.json")
  load_before = os.getloadavg()
  cmd = [sys.executable, "-m", "jax_qcomm.tools.cluster", "--nodes", "3", "--rate", "10mbit",
         "--local-devices", "1", "--out", path, "--", os.path.abspath(__file__), "node",
         "--repeat", str(repeat)]
  subprocess.run(cmd, check=True)
  with open(path) as f:
    data = json.load(f)
  data.update(command=f"python scripts/relay_pieces.py run --repeat {repeat}",
              load_before=load_before, load_after=os.getloadavg(), cpu=_cpu(),
              python=platform.python_version(),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
  table()


def table() -> None:
  with open(os.path.join(OUT, "relay.json")) as f:
    data = json.load(f)
  print(f"| MB | receivers | pieces | warm s (median of {data['repeat']}) | cold s (median of 2) |")
  print("|--:|--:|--:|--:|--:|")
  for r in data["rows"]:
    print(f"| {r['mb']} | {r['receivers']} | {r['pieces']} | {r['warm_s']:.2f} | "
          f"{r['cold_s']:.2f} |")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="what", required=True)
  node_parser = sub.add_parser("node")
  node_parser.add_argument("--out", required=True)
  node_parser.add_argument("--repeat", type=int, default=5)
  run_parser = sub.add_parser("run")
  run_parser.add_argument("--repeat", type=int, default=5)
  sub.add_parser("table")
  args = parser.parse_args()
  if args.what == "node":
    node(args.out, args.repeat)
  elif args.what == "run":
    run(args.repeat)
  else:
    table()
