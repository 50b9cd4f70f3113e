import pathlib, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository
from jax_qcomm.tools import distributed
distributed.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jax_qcomm.transport import _exchange
mesh = Mesh(np.array(jax.devices()), ("x",))
d = mesh.devices.size
W = 6_000_000 if d > 2 else 14_000_000
def rs_chunked(x, c):  # x [d, W/4] float32 -> psum_scatter per piece
  outs = []
  for s in range(0, x.shape[1], c):
    outs.append(lax.psum_scatter(x[:, s:s + c], "x", scatter_dimension=0, tiled=True))
  return jnp.concatenate(outs, axis=1)
def a2a_chunked(rows, c):
  return jnp.concatenate([_exchange.exchange(rows[:, s:s + c], "x") for s in range(0, W, c)], axis=1)
x = jax.device_put(np.random.default_rng(0).integers(0, 255, (d * d, W), np.uint8), jax.sharding.NamedSharding(mesh, P("x")))
f32 = jax.device_put(np.random.default_rng(0).standard_normal((d * d, W // 4), np.float32), jax.sharding.NamedSharding(mesh, P("x")))
kinds = [("a2a", a2a_chunked, x, (W, 2_000_000, 1_000_000, 500_000))]
if d == 2:
  kinds.append(("rs", rs_chunked, f32, (W // 4, 250_000, 125_000)))
for kind, fn, arg, cs in kinds:
  for c in cs:
    f = jax.jit(jax.shard_map(lambda r: fn(r, c), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for _ in range(2): jax.block_until_ready(f(arg))
    ts = []
    for _ in range(5):
      t = time.perf_counter(); jax.block_until_ready(f(arg)); ts.append(time.perf_counter() - t)
    floor = (d - 1) * W / 125e6
    print(f"[{jax.process_index()}] D={d} {kind} piece {c * (4 if kind == 'rs' else 1):>9,} B {1e3*np.median(ts):7.1f} ms  {np.median(ts)/floor:.2f}x", flush=True)
