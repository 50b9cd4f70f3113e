"""The sharded mode against the replicated sync: the update's time, its communication, and the
optimizer's own time.

ResNet50's parameters (``training.models.ResNet50``, flax layout: 161 leaves, 25,557,032 float32)
on a ``data`` axis of all devices (of all processes under the launcher), a different gradient on
every device, Adam inside::

    python -m benchmarks sharded --devices 2
    python -m benchmarks cluster --nodes 2 --rate 1gbit -- sharded [--gather-bits 8] [--comm-bucket N]

Five jitted calls, each ``update`` then ``optax.apply_updates`` with the state threaded (donated),
timed in interleaved rounds (median of ``--repeats``; across processes, call i takes the slowest
process's time):

* ``replicated``: ``qcomm.sync(adam, bits=bits)``: allreduce, Adam on every whole leaf;
* ``sharded``: ``qcomm.sync(adam, bits=bits, shard_state=True)`` (with ``--gather-bits g``:
  ``gather_codec=QSGD(g, rounding="nearest")``): reduce-scatter, Adam on this device's shards,
  all-gather of the weight differences;
* ``same_codec``: the replicated sync with the codec the sharded reduce-scatter resolves to (the
  same collectives; the same bytes where the differences travel at the gradients' width);
* ``adam``: Adam alone on the whole tree, no collective: the optimizer's own time, replicated;
* ``adam_shard``: Adam alone on this device's shards (the sharded mode's layout), no collective.

Communication = the mode's time minus its optimizer's own time. Bytes per device per step and
optimizer-state bytes per device are ``qcomm.describe``'s. ``--payload mlp:<n>`` replaces ResNet50
by two leaves of about n values in all (a quick run).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Sequence

import numpy as np
import optax

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.collectives.shard_layout import Layout
from jax_qcomm.transforms.sync import config_of
from jax_qcomm.tools import distributed

from benchmarks import _common, step

DEFAULT_OUT = "bench-results/sharded.json"
MODES = ("replicated", "sharded", "same_codec", "adam", "adam_shard")
SYNCS = ("replicated", "sharded", "same_codec")
_MLP = re.compile(r"mlp:([1-9][0-9]*)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The benchmark's own options (the common ones come from the registry)."""
  parser.add_argument("--payload", default="resnet50",
                      help="resnet50 (default) or mlp:<n> (two leaves, about n values)")
  parser.add_argument("--bits", type=int, default=4,
                      help="sync's bits= of the gradients: 1..8, 16, 32 (default: 4, Auto)")
  parser.add_argument("--gather-bits", type=int, default=None,
                      help="QSGD bits of the weight differences (default: sync's gather_codec)")
  parser.add_argument("--devices", type=int, default=None,
                      help="host devices of a single process (default: 2); under the launcher, "
                           "devices per process")
  parser.add_argument("--comm-bucket", type=_common.parse_size, default=None, metavar="N",
                      help="comm_bucket_size of every sync (per row when sharded; default: the "
                           "codecs' own comm_buffer_size)")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


def payload(name: str) -> dict[str, jax.ShapeDtypeStruct]:
  """The parameters' shapes: ResNet50's (flax) or a two-leaf MLP of about n values."""
  if name == "resnet50":
    from training import models  # noqa: PLC0415  (flax: only this payload needs it)

    model = models.ResNet50(num_classes=1000)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)),
                                                  train=False))
    return variables["params"]
  m = _MLP.fullmatch(name)
  if not m:
    raise SystemExit(f"--payload must be resnet50 or mlp:<n>, got {name!r}")
  width = max(1, int(np.sqrt(int(m.group(1)) / 2)))
  return {"w1": jax.ShapeDtypeStruct((width, width), jnp.float32),
          "w2": jax.ShapeDtypeStruct((width, width + 3), jnp.float32)}


def _arrays(mesh, shapes: Any, lead: bool, seed: int) -> Any:
  """Normal float32 arrays of ``shapes``: one per device (``(D, *shape)`` split over ``data``)
  when ``lead``, else replicated."""
  d = mesh.devices.size
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  out = []
  for k, s in enumerate(leaves):
    shape = tuple(s.shape)
    if lead:
      out.append(jax.make_array_from_callback(
          (d,) + shape, NamedSharding(mesh, P("data")),
          lambda idx, k=k, shape=shape: np.stack([
              np.random.default_rng([seed, k, g]).standard_normal(shape, dtype=np.float32)
              for g in range(*idx[0].indices(d))])))
    else:
      out.append(jax.make_array_from_callback(
          shape, NamedSharding(mesh, P()),
          lambda idx, k=k, shape=shape: np.random.default_rng([seed, k]).standard_normal(
              shape, dtype=np.float32)[idx]))
  return jax.tree_util.tree_unflatten(treedef, out)


def _sync_call(mesh, tx, shapes) -> tuple[Callable, Any, Any]:
  """(jitted step(params, state, grads) -> (params, state), params, state) of a sync."""
  params = _arrays(mesh, shapes, lead=False, seed=1)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, shapes))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def body(p, s, g):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return optax.apply_updates(p, u), s

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, P("data")),
                             out_specs=(P(), spec)), donate_argnums=(0, 1))
  return fn, params, state


def _local_call(mesh, opt, shapes) -> tuple[Callable, Any, Any]:
  """The same for ``opt`` alone on per-device parameters of ``shapes`` (no collective)."""
  params = _arrays(mesh, shapes, lead=True, seed=1)

  def init(p):
    return jax.tree_util.tree_map(lambda a: a[None], opt.init(jax.tree_util.tree_map(
        lambda a: a[0], p)))

  state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(params)

  def body(p, s, g):
    one = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)  # noqa: E731
    p1 = one(p)
    u, s1 = opt.update(one(g), one(s), p1)
    lead = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
    return lead(optax.apply_updates(p1, u)), lead(s1)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")),
               donate_argnums=(0, 1))
  return fn, params, state


class _Calls:
  """One call of ``fn`` per ``__call__``, the parameters and state threaded through."""

  def __init__(self, fn: Callable, params: Any, state: Any, grads: Any):
    self.fn, self.params, self.state, self.grads = fn, params, state, grads

  def __call__(self):
    self.params, self.state = self.fn(self.params, self.state, self.grads)
    return self.params


def run(args: argparse.Namespace, mesh) -> dict[str, Any]:
  d = mesh.devices.size
  shapes = payload(args.payload)
  n = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))
  adam = optax.adam(1e-3)
  gather = (None if args.gather_bits is None
            else qcomm.QSGD(args.gather_bits, rounding="nearest"))
  bound = dict(comm_bucket_size=args.comm_bucket)
  txs = {"replicated": qcomm.sync(adam, bits=args.bits, **bound),
         "sharded": qcomm.sync(adam, bits=args.bits, shard_state=True, gather_codec=gather,
                               **bound)}
  # The replicated sync with the codec the sharded reduce-scatter runs: the same collectives
  # (an all-to-all and an all-gather of QSGD payloads), the same bytes with 4-bit differences.
  txs["same_codec"] = qcomm.sync(adam, codec=config_of(txs["sharded"]).codec.resolve(
      d, "reduce_scatter"), **bound)
  layout = Layout.of([tuple(s.shape) for s in jax.tree_util.tree_leaves(shapes)], d,
                     [qcomm.NoCompression()] * len(jax.tree_util.tree_leaves(shapes)), 1 << 30)
  shard_shapes = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(shapes),
      [jax.ShapeDtypeStruct(leaf.shard_shape, jnp.float32) for leaf in layout.leaves])
  _common.log(f"{args.payload}: {n:,} parameters in {len(layout.leaves)} leaves, D={d}")

  grads_full = _arrays(mesh, shapes, lead=True, seed=2)
  grads_shard = _arrays(mesh, shard_shapes, lead=True, seed=2)
  calls = {name: _Calls(*_sync_call(mesh, tx, shapes), grads_full) for name, tx in txs.items()}
  calls["adam"] = _Calls(*_local_call(mesh, adam, shapes), grads_full)
  calls["adam_shard"] = _Calls(*_local_call(mesh, adam, shard_shapes), grads_shard)
  timings = step.time_interleaved(calls, repeats=args.repeats, warmup=args.warmup)

  desc = {name: qcomm.describe(tx, shapes, devices=d) for name, tx in txs.items()}
  t = {name: timings[name].median for name in MODES}
  comm = {"replicated": t["replicated"] - t["adam"], "sharded": t["sharded"] - t["adam_shard"],
          "same_codec": t["same_codec"] - t["adam"]}
  result = dict(
      payload=args.payload, parameters=n, leaves=len(layout.leaves), devices=d,
      comm_bucket_size=args.comm_bucket,
      processes=jax.process_count(), bits=args.bits,
      codecs={name: _codec_names(tx, d) for name, tx in txs.items()},
      timings={name: timings[name].as_dict() for name in MODES},
      update_s={name: t[name] for name in txs},
      optimizer_s={"replicated": t["adam"], "sharded": t["adam_shard"], "same_codec": t["adam"]},
      comm_s=comm, comm_ratio=comm["sharded"] / comm["replicated"],
      update_ratio=t["sharded"] / t["replicated"], optimizer_ratio=t["adam_shard"] / t["adam"],
      comm_ratio_same_codec=comm["sharded"] / comm["same_codec"],
      update_ratio_same_codec=t["sharded"] / t["same_codec"],
      sent_bytes_per_device={name: desc[name].sent_bytes_per_sync for name in txs},
      state_bytes_per_device={name: desc[name].state_bytes_per_device for name in txs},
      padded_elements_per_device=sum(leaf.size for leaf in layout.leaves) - -(-n // d))
  return result


def _codec_names(tx, devices: int) -> str:
  """What the sync's codecs resolve to at ``devices`` on this transport (Auto's choice)."""
  cfg = config_of(tx)
  if cfg.shard_state:
    return (f"{cfg.codec.resolve(devices, 'reduce_scatter').name} reduce-scatter, "
            f"{cfg.gather_codec.resolve(devices, 'all_gather').name} all-gather")
  return f"{cfg.codec.resolve(devices).name} allreduce"


def format_result(r: dict[str, Any], meta: dict[str, Any]) -> str:
  buffers = r.get("comm_bucket_size") or "the codecs' own"
  ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
  label = {"replicated": "replicated", "sharded": "sharded",
           "same_codec": "replicated, the reduce-scatter's codec"}
  rows = [[label[m], ms(r["update_s"][m]), ms(r["optimizer_s"][m]), ms(r["comm_s"][m]),
           f"{r['sent_bytes_per_device'][m]:,.0f}", f"{r['state_bytes_per_device'][m] or 0:,}"]
          for m in SYNCS]
  rows += [["sharded / replicated", f"{r['update_ratio']:.3f}", f"{r['optimizer_ratio']:.3f}",
            f"{r['comm_ratio']:.3f}", "", ""],
           ["sharded / same codec", f"{r['update_ratio_same_codec']:.3f}",
            f"{r['optimizer_ratio']:.3f}", f"{r['comm_ratio_same_codec']:.3f}", "", ""]]
  head = ["mode", "update ms", "optimizer ms", "communication ms", "sent B/device",
          "state B/device"]
  return "\n".join([
      f"sharded vs replicated sync: {r['payload']} ({r['parameters']:,} params), bits="
      f"{r['bits']}: replicated {r['codecs']['replicated']}; sharded {r['codecs']['sharded']}; "
      f"same codec {r['codecs']['same_codec']}; buffers {buffers}; "
      f"D={r['devices']} in {r['processes']} process(es)  |  {_common.machine_line(meta)}", "",
      _common.format_table(head, rows, align="l" + "r" * (len(head) - 1)), "",
      f"median of {meta['config']['repeats']} interleaved rounds after {meta['config']['warmup']} "
      "warmup calls; communication = update - the optimizer's own time (Adam alone, no "
      "collective, on the whole tree / on this device's shards).",
      _common.malloc_note(meta["malloc"])])


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark; process 0 prints the table and writes the JSON."""
  if not (1 <= args.bits <= 8 or args.bits in (16, 32)):
    raise SystemExit(f"--bits must be 1..8, 16 or 32, got {args.bits}")
  for name in ("gather_bits",):
    if getattr(args, name) is not None and not 1 <= getattr(args, name) <= 8:
      raise SystemExit(f"--{name.replace('_', '-')} must be 1..8, got {getattr(args, name)}")
  single = args.devices is None and not distributed.under_launcher()
  _common.init_devices(2 if single else args.devices)
  mesh, meta = _common.mesh_and_metadata("sharded", command)
  meta["config"] = dict(payload=args.payload, bits=args.bits, gather_bits=args.gather_bits,
                        comm_bucket=args.comm_bucket,
                        repeats=args.repeats, warmup=args.warmup, optimizer="adam(1e-3)")
  result = run(args, mesh)
  if jax.process_index() == 0:
    print(format_result(result, meta))
    path = _common.write_json(args.out, dict(metadata=meta, result=result))
    print(f"wrote {path}")
  return 0

