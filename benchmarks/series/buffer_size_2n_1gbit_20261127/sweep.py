"""Communication buffer size against step time: `sync(adam, ...)`'s update and apply on ResNet-50's
gradient (the sharded benchmark's harness, benchmarks/sharded.py: donated state, per-device normal
gradients), each variant's calls interleaved in 7 rounds after 3 warmup calls; per process the
median, and the median of the per-round ratios to the replicated QSGD 4 sync ("same codec").

    QCOMM_MALLOC=reuse python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \\
        --malloc glibc -- benchmarks/series/buffer_size_2n_1gbit_20261127/sweep.py
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from jax_qcomm.tools import distributed  # noqa: E402

distributed.initialize()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402
from benchmarks import sharded as B  # noqa: E402
from jax_qcomm.transforms.sync import config_of  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("data",))
d = mesh.devices.size
shapes = B.payload("resnet50")
adam = optax.adam(1e-3)
sharded = qcomm.sync(adam, bits=4, shard_state=True)
qsgd = config_of(sharded).codec.resolve(d, "reduce_scatter")
txs = {"same_codec": qcomm.sync(adam, codec=qsgd), "replicated": qcomm.sync(adam, bits=4),
       "sharded": sharded}
for m in (6.4, 3.2, 1.6):
  n = int(m * 1e6)
  txs[f"same_codec_{m}M"] = qcomm.sync(adam, codec=qsgd, comm_bucket_size=n)
  txs[f"replicated_{m}M"] = qcomm.sync(adam, bits=4, comm_bucket_size=n)
  txs[f"sharded_{m}M"] = qcomm.sync(adam, bits=4, shard_state=True, comm_bucket_size=n)
grads = B._arrays(mesh, shapes, lead=True, seed=0)
calls = {}
for name, tx in txs.items():
  fn, p, s = B._sync_call(mesh, tx, shapes)
  calls[name] = B._Calls(fn, p, s, grads)
  for _ in range(3):
    jax.block_until_ready(calls[name]())
times = {k: [] for k in calls}
for _ in range(7):
  for name, c in calls.items():
    t = time.perf_counter()
    jax.block_until_ready(c())
    times[name].append(time.perf_counter() - t)
base = np.array(times["same_codec"])
for name, ts in times.items():
  print(f"[{jax.process_index()}] {name:16s} median {1e3 * np.median(ts):6.1f} ms  "
        f"/ same codec {np.median(np.array(ts) / base):.3f}", flush=True)
