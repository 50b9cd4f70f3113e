"""End-to-end data-parallel training step: compute vs communication, measured and modelled.

A wide MLP whose gradient is large relative to its compute (default 1024-4096-4096-1024: 25.2M
float32 parameters) is trained data-parallel under ``jax.shard_map`` over a ``"data"`` axis of all
devices (of all processes under the launcher) with ``qcomm.sync(optax.sgd(momentum=0.9), bits=...,
accum_steps=k)``::

    python -m benchmarks step --devices 4 --codecs fp32,bf16,qsgd4 --accum 1,2
    python -m jax_qcomm.tools.launch -n 4 -m benchmarks step --link-gbps 1

Timed per accumulation ``k``: a full cycle of ``k`` micro-steps (each a jitted call, the state
threaded through), the no-sync step and every codec's step in interleaved rounds (one cycle of each
per round, so that a change of machine load hits them alike); median over ``--repeats`` rounds;
across processes, cycle i takes the slowest process's time. All numbers are **per optimizer step**
(one cycle):

* ``Ts``: the same cycle without any synchronisation: local gradients, local float32 accumulation,
  the inner optimizer on the local mean every ``k`` micro-steps (each device's parameters are its
  own; no collective at all) -- the same compute;
* ``Tstep``: the cycle with ``qcomm.sync`` (one allreduce, on the k-th micro-step);
* ``Tc = Tstep - Ts`` (of the medians; ``tc_paired_median_s``: the median of the per-round
  differences) and ``eta = Ts / Tstep`` (= ts/(ts + Tc/k) with ts the compute per micro-step,
  :func:`jax_qcomm.tools.efficiency.scaling_efficiency`).

Beside the measurement, the cost model (:mod:`jax_qcomm.tools.efficiency`): wire bytes per device of the
gradient pytree (the library's leaf policy and packing: biases travel exact), transfer at
``--link-gbps`` (or, without it, at the effective rate of the measured fp32 ``Tc`` at k=1:
"calibrated"), ``2 (D-1)`` messages x ``--latency-us`` per buffer, plus the codec work measured
here: every device runs, at once and without communication, the codec work of one SRA allreduce of
the gradient's compressed buffers (encode D chunks, decode-and-sum, re-encode, decode D), which
gives the codec throughput in elements per second. Model: ``Tstep = Ts + Tc_model`` with
``Tc_model = transfer + codec`` (``model_tc_s``, serial) and ``max(transfer, codec)``
(``model_tc_overlap_s``, codec work hidden behind the transfer of other buffers).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import numpy as np
import optax

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.tools import efficiency
from jax_qcomm.codecs import codec_for_bits

from benchmarks import _common

DEFAULT_OUT = "bench-results/step.json"
DEFAULT_DEVICES = 4
#: codec name -> bits of qcomm.sync
CODECS = {"fp32": 32, "bf16": 16, "qsgd8": 8, "qsgd4": 4, "qsgd2": 2, "sum4": 4, "sum2": 2}
#: codec names of qcomm.sync(..., summable=True) (qcomm.Summable: one pmax + one psum)
SUMMABLE = ("sum4", "sum2")
DEFAULT_CODECS = ("fp32", "bf16", "qsgd4")


def _codec_list(text: str) -> list[str]:
  names = [v for v in text.replace(",", " ").split()]
  bad = [v for v in names if v not in CODECS]
  if not names or bad:
    raise argparse.ArgumentTypeError(f"codecs must be among {', '.join(CODECS)}, got {text!r}")
  return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the step benchmark's options to its subcommand parser."""
  parser.add_argument("--codecs", type=_codec_list, default=list(DEFAULT_CODECS),
                      help=f"comma-separated, among {','.join(CODECS)} (default: "
                           f"{','.join(DEFAULT_CODECS)})")
  parser.add_argument("--accum", type=_common.int_list, default=[1, 2],
                      help="comma-separated accumulation steps (default: 1,2)")
  parser.add_argument("--hidden", type=_common.int_list, default=[4096, 4096],
                      help="hidden layer widths of the MLP (default: 4096,4096)")
  parser.add_argument("--in-dim", type=int, default=1024, help="input features (default: 1024)")
  parser.add_argument("--out-dim", type=int, default=1024, help="outputs (default: 1024)")
  parser.add_argument("--batch", type=int, default=16,
                      help="examples per device per micro-step (default: 16)")
  parser.add_argument("--bucket", type=int, default=128, help="QSGD bucket size (default: 128)")
  parser.add_argument("--devices", type=int, default=None,
                      help=f"host devices per process (default: {DEFAULT_DEVICES} in a single "
                           "process; under the launcher QCOMM_LOCAL_DEVICES, else 1)")
  parser.add_argument("--link-gbps", type=float, default=None,
                      help="link rate in Gbit/s for the model (default: calibrated from the "
                           "measured fp32 Tc)")
  parser.add_argument("--latency-us", type=float, default=0.0,
                      help="per-message latency of the model in microseconds (default: 0)")
  parser.add_argument("--no-codec-probe", action="store_true",
                      help="do not measure the codec work (the model then counts it as free)")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


# -- the model being trained ------------------------------------------------------------------------

def layer_dims(in_dim: int, hidden: Sequence[int], out_dim: int) -> list[int]:
  return [in_dim, *hidden, out_dim]


def init_params(dims: Sequence[int], seed: int = 0) -> dict[str, Any]:
  """numpy float32 parameters {"layer_i": {"w": [a, b], "b": [b]}} (He-style scale)."""
  rng = np.random.default_rng(seed)
  return {f"layer_{i}": {"w": (rng.standard_normal((a, b), dtype=np.float32)
                               * np.float32(np.sqrt(2.0 / a))),
                         "b": np.zeros((b,), np.float32)}
          for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}


def loss_fn(params: dict[str, Any], x, y):
  """Mean squared error of a ReLU MLP."""
  h = x
  n = len(params)
  for i in range(n):
    p = params[f"layer_{i}"]
    h = h @ p["w"] + p["b"]
    if i < n - 1:
      h = jax.nn.relu(h)
  return jnp.mean((h - y) ** 2)


# -- step functions ---------------------------------------------------------------------------------

def _inner(lr: float):
  return optax.sgd(lr, momentum=0.9)


def make_codec(name: str, bucket: int):
  """The codec a benchmark name stands for (SUMMABLE names: qcomm.Summable; the rest: bits)."""
  if name in SUMMABLE:
    return qcomm.Summable(CODECS[name], bucket)
  return codec_for_bits(CODECS[name], bucket)


def make_sync_step(mesh, params_shape, codec, accum: int, lr: float):
  """(jitted step(params, state, x, y) -> (params, state), state init) with qcomm.sync."""
  tx = qcomm.sync(_inner(lr), axis_name="data", codec=codec, accum_steps=accum)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params_shape))

  def train_step(params, opt_state, x, y):
    local = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)
    grads = jax.grad(loss_fn)(local, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), spec, P("data"), P("data")),
                               out_specs=(P(), spec)), donate_argnums=(0, 1))
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))
  return step, init


def make_local_step(mesh, accum: int, lr: float):
  """The same step without synchronisation: every device keeps its own parameters (global
  arrays with a leading device axis, ``P("data")``), accumulates its gradients locally and steps
  the inner optimizer on their mean every ``accum`` calls. No collective."""
  inner = _inner(lr)
  squeeze = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
  expand = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731

  def init(params):
    p = squeeze(params)
    acc = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p) if accum > 1 else ()
    return expand((inner.init(p), jnp.zeros((), jnp.int32), acc))

  def train_step(params, state, x, y):
    p = squeeze(params)
    inner_state, count, acc = squeeze(state)
    grads = jax.grad(loss_fn)(p, x, y)
    if accum == 1:
      updates, inner_state = inner.update(grads, inner_state, p)
    else:
      acc = jax.tree.map(jnp.add, acc, grads)
      count = count + 1

      def do():
        mean = jax.tree.map(lambda a: a * jnp.float32(1.0 / accum), acc)
        u, s = inner.update(mean, inner_state, p)
        return u, s, jnp.zeros_like(count), jax.tree.map(jnp.zeros_like, acc)

      def skip():
        return jax.tree.map(jnp.zeros_like, grads), inner_state, count, acc

      updates, inner_state, count, acc = lax.cond(count >= accum, do, skip)
    return expand(optax.apply_updates(p, updates)), expand((inner_state, count, acc))

  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=P("data"), out_specs=P("data")),
                 donate_argnums=(0, 1))
  init_fn = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  return step, init_fn


# -- arrays -----------------------------------------------------------------------------------------

def _replicated(mesh, tree: Any) -> Any:
  """numpy pytree -> global arrays replicated over the mesh (works across processes)."""
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx]),
                      tree)


def _per_device(mesh, tree: Any) -> Any:
  """numpy pytree -> global arrays [D, ...] with the same copy on every device (``P("data")``)."""
  d = mesh.devices.size
  sharding = NamedSharding(mesh, P("data"))

  def one(a):
    def cb(idx):
      rows = len(range(*idx[0].indices(d)))
      return np.broadcast_to(a[None], (rows,) + a.shape)[(slice(None),) + tuple(idx[1:])]
    return jax.make_array_from_callback((d,) + a.shape, sharding, cb)

  return jax.tree.map(one, tree)


def _batch(mesh, batch: int, dim: int, seed: int):
  """float32[D * batch, dim], device g's rows normal with a device-dependent seed."""
  d = mesh.devices.size

  def rows(idx):
    start, stop, _ = idx[0].indices(d * batch)
    return np.concatenate([np.random.default_rng([seed, g]).standard_normal((batch, dim),
                                                                            dtype=np.float32)
                           for g in range(start // batch, stop // batch)])

  return jax.make_array_from_callback((d * batch, dim), NamedSharding(mesh, P("data")), rows)


# -- timing -----------------------------------------------------------------------------------------

class Cycler:
  """Runs cycles of ``accum`` calls of a jitted ``step(params, state, x, y)``, threading the
  state through (the arguments are donated, so the latest outputs are kept here)."""

  def __init__(self, step: Callable, params: Any, state: Any, x, y, accum: int):
    self.step, self.params, self.state, self.x, self.y, self.accum = step, params, state, x, y, accum

  def __call__(self):
    p, s = self.params, self.state
    for _ in range(self.accum):
      p, s = self.step(p, s, self.x, self.y)
    self.params, self.state = p, s
    return p


def time_interleaved(cyclers: dict[str, Cycler], *, repeats: int,
                     warmup: int) -> dict[str, _common.Timing]:
  """Times the cyclers in rounds: every round runs one cycle of each, in an order shuffled from
  round to round (the same on every process: a fixed seed), so that a change of machine load hits
  all of them alike, ``Tstep - Ts`` compares neighbouring cycles, and no cycler always follows the
  same other one (a rotation would keep each one's predecessor). Each cycle is waited for; across
  processes, cycle i of each cycler takes the slowest process's time."""
  if repeats < 1 or warmup < 1:
    raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
  names = list(cyclers)
  for name in names:
    for _ in range(warmup):
      jax.block_until_ready(cyclers[name]())
  times: dict[str, list[float]] = {name: [] for name in names}
  orders = np.random.default_rng(0)
  with _common.gc_paused():
    for _ in range(repeats):
      for k in orders.permutation(len(names)):
        name = names[k]
        start = time.perf_counter()
        jax.block_until_ready(cyclers[name]())
        times[name].append(time.perf_counter() - start)
  return {name: _common.collective_timing(_common.Timing(tuple(t))) for name, t in times.items()}


def codec_probe(mesh, buffers: Sequence[int], codec, *, repeats: int, warmup: int) -> float:
  """Seconds of one device's codec work in one SRA allreduce of flat buffers of the given sizes,
  every device working at once (no communication): encode D chunks, decode-and-sum D payloads,
  re-encode the reduced chunk, decode D payloads."""
  d = mesh.devices.size
  sizes = [codec.buffer_length(n, d) for n in buffers]

  def work(*xs):
    outs = []
    key = jax.random.key(3)
    for x in xs:
      v = x[0]
      c = v.shape[0] // d
      chunks = v.reshape(d, c)
      payloads = jax.vmap(codec.encode)(chunks, jax.random.split(key, d))
      reduced = codec.decode_sum(payloads, (c,))
      mine = codec.encode(reduced, key)
      decoded = jax.vmap(lambda q: codec.decode(q, (c,)))(payloads)
      outs += [mine[None], decoded.reshape(1, -1)]
    return tuple(outs)

  fn = jax.jit(jax.shard_map(work, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  sharding = NamedSharding(mesh, P("data"))
  xs = [jax.make_array_from_callback(
      (d, n), sharding,
      lambda idx, n=n: np.random.default_rng(5).standard_normal(
          (len(range(*idx[0].indices(d))), n), dtype=np.float32)) for n in sizes]
  t = _common.collective_timing(_common.median_time(fn, *xs, repeats=repeats, warmup=warmup))
  return t.median


# -- the benchmark ----------------------------------------------------------------------------------

def run(args: argparse.Namespace, mesh) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Measures every (accum, codec); returns the rows and a summary of the model's inputs."""
  d = mesh.devices.size
  dims = layer_dims(args.in_dim, args.hidden, args.out_dim)
  params_np = init_params(dims)
  params_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params_np)
  n_params = sum(a.size for a in jax.tree.leaves(params_np))
  x = _batch(mesh, args.batch, args.in_dim, 11)
  y = _batch(mesh, args.batch, args.out_dim, 12)
  lr = 1e-3
  flops = 6 * args.batch * sum(a * b for a, b in zip(dims[:-1], dims[1:]))
  _common.log(f"MLP {'-'.join(map(str, dims))}: {n_params:,} parameters, batch {args.batch} per device, "
       f"~{flops / 1e9:.2f} GFLOP per device per micro-step, D={d}")

  # codec work, per lossy codec (model input)
  comm = {}
  for name in args.codecs:
    codec = make_codec(name, args.bucket)
    info = efficiency.tree_allreduce_bytes(params_shape, d, codec)
    codec_s = None
    # The probe times the SRA's codec work; a summable codec's (encode + decode once) is not probed.
    if codec.lossy and name not in SUMMABLE and not args.no_codec_probe and d > 1:
      lossy = [n for (c, n, _) in info["buffers"] if c == repr(codec)]
      codec_s = codec_probe(mesh, lossy, codec, repeats=args.repeats, warmup=args.warmup)
      _common.log(f"  codec work {name:<6} {1e3 * codec_s:9.1f} ms per allreduce "
           f"({info['coded_elements'] / codec_s / 1e6:.0f} M elem/s)")
    comm[name] = dict(info, codec_s=codec_s,
                      codec_elems_per_s=(info["coded_elements"] / codec_s) if codec_s else None)

  rows = []
  for k in args.accum:
    # Ts (no sync) and every codec's Tstep, timed in interleaved rounds.
    lstep, linit = make_local_step(mesh, k, lr)
    p_dev = _per_device(mesh, params_np)
    cyclers = {"": Cycler(lstep, p_dev, linit(p_dev), x, y, k)}
    del p_dev
    for name in args.codecs:
      step, init = make_sync_step(mesh, params_shape, make_codec(name, args.bucket), k, lr)
      params = _replicated(mesh, params_np)
      cyclers[name] = Cycler(step, params, init(params), x, y, k)
      del params
    timings = time_interleaved(cyclers, repeats=args.repeats, warmup=args.warmup)
    del cyclers
    ts = timings[""]
    _common.log(f"  k={k} Ts (no sync) {1e3 * ts.median:9.1f} ms per optimizer step")
    for name in args.codecs:
      tstep = timings[name]
      c = comm[name]
      tc = tstep.median - ts.median
      paired = sorted(a - b for a, b in zip(tstep.times, ts.times))
      _common.log(f"  k={k} {name:<6} Tstep {1e3 * tstep.median:9.1f} ms  Tc {1e3 * tc:9.1f} ms  "
           f"eta {ts.median / tstep.median:.3f}")
      rows.append(dict(
          codec=name, bits=CODECS[name], accum_steps=k, devices=d,
          processes=jax.process_count(), parameters=n_params, batch_per_device=args.batch,
          flops_per_device_micro_step=flops,
          wire_bytes_per_device=c["bytes"], messages_per_device=c["messages"],
          coded_elements=c["coded_elements"],
          ts_s=ts.median, ts_micro_s=ts.median / k, ts_timing=ts.as_dict(),
          tstep_s=tstep.median, tstep_timing=tstep.as_dict(),
          tc_s=tc, tc_paired_median_s=paired[len(paired) // 2] if len(paired) % 2 else
          (paired[len(paired) // 2 - 1] + paired[len(paired) // 2]) / 2,
          eta=ts.median / tstep.median,
          busbw_gb_per_s=(c["bytes"] / tc / 1e9) if tc > 0 and c["bytes"] else None,
          algbw_gb_per_s=(4 * n_params / tc / 1e9) if tc > 0 else None,
          codec_work_s=c["codec_s"], codec_elems_per_s=c["codec_elems_per_s"]))
  link_gbps, source = args.link_gbps, "given"
  if link_gbps is None:
    source = "calibrated"
    base = next((r for r in rows if r["codec"] == "fp32" and r["accum_steps"] == args.accum[0]),
                None)
    link_gbps = None
    if base is not None and base["tc_s"] > 0 and base["wire_bytes_per_device"]:
      link_gbps = base["wire_bytes_per_device"] * 8 / base["tc_s"] / 1e9
    else:
      source = None
  for r in rows:
    model = dict(model_transfer_s=None, model_codec_s=None, model_tc_s=None, model_tstep_s=None,
                 model_eta=None, model_tc_overlap_s=None, model_eta_overlap=None)
    if link_gbps is not None and d > 1:
      transfer = efficiency.transfer_time(r["wire_bytes_per_device"], link_gbps,
                                          latency_s=args.latency_us * 1e-6,
                                          messages=r["messages_per_device"])
      codec_t = efficiency.codec_time(r["coded_elements"], r["codec_elems_per_s"])
      tc_model = transfer + codec_t
      model = dict(model_transfer_s=transfer, model_codec_s=codec_t, model_tc_s=tc_model,
                   model_tc_overlap_s=max(transfer, codec_t),
                   model_eta_overlap=efficiency.scaling_efficiency(
                       r["ts_micro_s"], max(transfer, codec_t), r["accum_steps"]),
                   model_tstep_s=efficiency.optimizer_step_time(r["ts_micro_s"], tc_model,
                                                                r["accum_steps"]),
                   model_eta=efficiency.scaling_efficiency(r["ts_micro_s"], tc_model,
                                                           r["accum_steps"]))
    r.update(model)
  base = {r["accum_steps"]: r for r in rows if r["codec"] == "fp32"}
  for r in rows:
    b = base.get(r["accum_steps"])
    r["speedup_vs_fp32"] = b["tstep_s"] / r["tstep_s"] if b else None
  summary = dict(model_link_gbps=link_gbps, model_link_source=source,
                 model_latency_s=args.latency_us * 1e-6, layer_dims=dims, parameters=n_params)
  return rows, summary


def format_results(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
  """The printed report."""
  cfg = meta["config"]
  headers = ["codec", "k", "wire MB", "Ts ms", "Tstep ms", "Tc ms", "eta", "vs fp32",
             "codec ms", "model Tc ms", "model eta"]
  fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
  table = [[r["codec"], r["accum_steps"], f"{r['wire_bytes_per_device'] / 1e6:.2f}",
            f"{1e3 * r['ts_s']:.1f}", f"{1e3 * r['tstep_s']:.1f}", f"{1e3 * r['tc_s']:.1f}",
            f"{r['eta']:.3f}", fmt(r["speedup_vs_fp32"], ".2f"),
            fmt(None if r["codec_work_s"] is None else 1e3 * r["codec_work_s"], ".1f"),
            fmt(None if r["model_tc_s"] is None else 1e3 * r["model_tc_s"], ".1f"),
            fmt(r["model_eta"], ".3f")] for r in rows]
  link = meta["model"]["model_link_gbps"]
  src = meta["model"]["model_link_source"]
  lines = [
      f"training step (MLP {'-'.join(map(str, meta['model']['layer_dims']))}, "
      f"{meta['model']['parameters']:,} params, batch {cfg['batch']}/device) over "
      f"D={meta['num_devices']} devices in {meta['num_processes']} process(es)  |  "
      f"{_common.machine_line(meta)}",
      "",
      _common.format_table(headers, table, align="l" + "r" * (len(headers) - 1)),
      "",
      f"per optimizer step (a cycle of k micro-steps), median of {cfg['repeats']} interleaved rounds after "
      f"{cfg['warmup']} warmup cycles" + ("; per cycle, the slowest process" if
                                          meta["num_processes"] > 1 else "") + ".",
      "Ts: no synchronisation (same compute); Tstep: with qcomm.sync; Tc = Tstep - Ts; "
      "eta = Ts / Tstep. wire MB: bytes each device sends per allreduce (biases exact).",
      "model: Tc = wire bytes / link + codec work (measured, all devices at once); link "
      + ("n/a" if link is None else f"{link:.3f} Gbit/s ({src})") + ".",
      _common.malloc_note(meta["malloc"]),
  ]
  return "\n".join(lines)


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark; process 0 prints the table and writes the JSON."""
  try:  # the codecs' own validation of --bucket, before any work
    for name in args.codecs:
      codec_for_bits(CODECS[name], args.bucket)
  except ValueError as e:
    raise SystemExit(f"error: --bucket {args.bucket}: {e}") from None
  for name in ("in_dim", "out_dim", "batch"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.latency_us < 0:
    raise SystemExit(f"--latency-us must be >= 0, got {args.latency_us}")

  _common.init_devices(args.devices)

  mesh, meta = _common.mesh_and_metadata("step", command)
  d = mesh.devices.size
  meta["config"] = dict(codecs=args.codecs, accum=args.accum, hidden=args.hidden,
                        in_dim=args.in_dim, out_dim=args.out_dim, batch=args.batch,
                        bucket_size=args.bucket, repeats=args.repeats, warmup=args.warmup,
                        link_gbps=args.link_gbps, latency_us=args.latency_us,
                        codec_probe=not args.no_codec_probe,
                        optimizer="sgd(1e-3, momentum=0.9)", loss="mse")
  _common.log(_common.malloc_note(meta["malloc"]))
  if d == 1:
    _common.log("warning: one device only: nothing is communicated")
  rows, summary = run(args, mesh)
  meta["model"] = summary
  if jax.process_index() == 0:
    print(format_results(rows, meta))
    path = _common.write_json(args.out, dict(metadata=meta, rows=rows))
    print(f"wrote {path}")
  return 0
