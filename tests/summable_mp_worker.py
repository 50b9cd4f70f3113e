"""Worker of tests/test_summable.py::test_summable_allreduce_across_processes, started as

    python -m jax_qcomm.tools.launch -n 2 --local-devices 2 tests/summable_mp_worker.py

Every process joins jax.distributed (gloo), runs the summable allreduce (one pmax of int32 scale
words, one psum of uint32 words, across processes) over the global mesh and checks its own rows
against the host model (each device's words, encoded locally with its key, added in numpy and
decoded once): bit for bit. Exits 1 on a mismatch.
"""

import sys
import numpy as np
from jax_qcomm.tools import distributed
distributed.initialize()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_qcomm as qcomm
pid = jax.process_index()
mesh = distributed.global_mesh(("data",))
d = mesh.devices.size
n = 3000
def inp(g): return (np.random.default_rng(g).standard_normal(n) * (1 + g)).astype(np.float32)
x = jax.make_array_from_callback((d, n), NamedSharding(mesh, P("data")),
                                 lambda idx: np.stack([inp(g) for g in range(*idx[0].indices(d))]))
ok = True
for bits, op in ((4, "mean"), (8, "sum"), (2, "mean")):
  codec = qcomm.Summable(bits, 128)
  key = jax.random.key(7)
  f = jax.jit(jax.shard_map(lambda v, k: qcomm.allreduce(v[0], "data", codec=codec, key=k, op=op)[None],
                            mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
  out = f(x, key)
  text = f.lower(x, key).compile().as_text()
  rows = [np.asarray(s.data)[0] for s in out.addressable_shards]
  # host model on this process's first local device, no collectives
  xs = np.stack([inp(g) for g in range(d)])
  c = codec
  shared = np.max(np.stack([np.asarray(jax.jit(c.bucket_scale)(jnp.asarray(v))) for v in xs]), axis=0)
  # a reduction shares each maximum rounded up to bfloat16 bits
  up = (shared.view(np.uint32) >> 16) + ((shared.view(np.uint32) & 0xFFFF) != 0)
  shared = (up.astype(np.uint32) << 16).view(np.int32)
  keys = [jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 0), g), 0) for g in range(d)]
  enc = jax.jit(lambda v, m, k: c.wire_encode_summable(v, m, k, d))
  words = np.stack([np.asarray(enc(jnp.asarray(v), shared, k)) for v, k in zip(xs, keys)]).sum(0, dtype=np.uint32)
  want = np.asarray(jax.jit(lambda w, m: c.decode_summed_words(w, m, d, d, n, 1.0 / d if op == "mean" else 1.0))(words, shared))
  same = all(np.array_equal(r, want) for r in rows)
  ok &= same
  print(f"process {pid}: bits {bits} {op}: equal to host model: {same}; all-reduce ops in HLO: "
        f"{text.count('all-reduce(') + text.count('all-reduce-start(')}", flush=True)
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("done")
print(f"process {pid}: {'OK' if ok else 'MISMATCH'}", flush=True)
sys.exit(0 if ok else 1)
