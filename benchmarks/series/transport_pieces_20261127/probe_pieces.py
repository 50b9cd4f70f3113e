import pathlib, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository
from jax_qcomm.tools import distributed
distributed.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
d = mesh.devices.size
W = 14_000_000
def swap_chunked(rows, c, chain):
  # rows [d, W] uint8 -> all_to_all in chunks of c bytes along W
  outs = []
  prev = None
  for s in range(0, W, c):
    piece = rows[:, s:s + c]
    if chain and prev is not None:
      piece, _ = lax.optimization_barrier((piece, prev))
    o = lax.all_to_all(piece, "x", 0, 0, tiled=True)
    outs.append(o); prev = o
  return jnp.concatenate(outs, axis=1)
def gather_chunked(row, c, chain):
  outs = []; prev = None
  for s in range(0, W, c):
    piece = row[s:s + c]
    if chain and prev is not None:
      piece, _ = lax.optimization_barrier((piece, prev))
    o = lax.all_gather(piece, "x", tiled=True)
    outs.append(o.reshape(d, -1)); prev = o
  return jnp.concatenate(outs, axis=1)
x = jax.device_put(np.random.default_rng(0).integers(0, 255, (d * d, W), np.uint8),
                   jax.sharding.NamedSharding(mesh, P("x")))
g = jax.device_put(np.random.default_rng(1).integers(0, 255, (d * W,), np.uint8),
                   jax.sharding.NamedSharding(mesh, P("x")))
res = {}
for kind in ("a2a", "ag"):
  for c in (W, 4_000_000, 2_000_000, 1_000_000, 500_000, 250_000):
    for chain in ((False, True) if c < W else (False,)):
      if kind == "a2a":
        f = jax.jit(jax.shard_map(lambda r: swap_chunked(r, c, chain), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        arg = x
      else:
        f = jax.jit(jax.shard_map(lambda r: gather_chunked(r, c, chain), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        arg = g
      for _ in range(2): jax.block_until_ready(f(arg))
      ts = []
      for _ in range(5):
        t = time.perf_counter(); jax.block_until_ready(f(arg)); ts.append(time.perf_counter() - t)
      floor = (d - 1) / d * d * W / 125e6 if kind == "a2a" else (d - 1) * W / 125e6
      print(f"[{jax.process_index()}] {kind} chunk {c:>9,} chain={chain!s:5} {1e3*np.median(ts):7.1f} ms  {np.median(ts)/floor:.2f}x", flush=True)
