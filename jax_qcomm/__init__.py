"""jax_qcomm: compressed gradient collectives for JAX.

The package is cut into layers, lowest first; each imports only the layers below it
(docs/architecture.md, held by tests/test_layers.py): ``native`` (the wire format and the compiled
kernels' binding), ``transport`` (axes, exchange schedules, the transport's cost model),
``codecs``, ``collectives`` (pytrees, packing, shard layouts, the public collectives),
``transforms`` (the optax transformations), ``runners`` (the train steps). ``tools`` sits above the
library and is never imported by it.

Codecs (:class:`Codec`: QSGD and Summable as XLA FFI kernels -- C++ on CPU, CUDA on NVIDIA GPUs --
with a pure-JAX reference of the same wire format; Cast; NoCompression), each reducing across
devices through one protocol, the collectives built on it (inside ``jax.shard_map`` /
``jax.pmap``) and the optax wrapper :func:`sync`.
The tooling above the library -- the cost model and the multi-process runtime -- is imported on its
own: ``from jax_qcomm.tools import efficiency, distributed`` (this module never imports it).
"""

import sys

from jax_qcomm.native import _ffi
from jax_qcomm.native._selftest import implementation, self_test
from jax_qcomm import transport
from jax_qcomm.codecs import (QSGD, Auto, Cast, Codec, NoCompression, PowerSGD, Summable, TopK,
                              Wire16, codec_for_bits)
from jax_qcomm.transport.axes import Hierarchical
from jax_qcomm.collectives import (ParamShard, all_gather, allreduce, cast_pmean, gather_params,
                                   hpz_remat_policy, reduce_scatter, reshard_params,
                                   shard_params, shard_specs, unshard_params)
from jax_qcomm.collectives.packing import LeafPolicy
from jax_qcomm.transforms.accumulation import accumulate_gradients
from jax_qcomm.transforms.sync import ShardedSyncState, SyncState, sync
from jax_qcomm.transforms.param_shards import ParamShardSyncState
from jax_qcomm.transforms.specs import local_params, state_partition_spec
from jax_qcomm.transforms.clipping import clip_by_global_norm
from jax_qcomm.runners.data_parallel import DataParallel, data_parallel
from jax_qcomm.transforms.describe import Description, describe
from jax_qcomm.transforms.diloco import DiLoCoState, diloco

_ffi.register()

__all__ = [
    "QSGD", "Auto", "Cast", "Codec", "NoCompression", "Summable", "Wire16", "TopK", "PowerSGD",
    "transport",
    "Hierarchical", "LeafPolicy", "allreduce", "reduce_scatter", "all_gather", "cast_pmean",
    "gather_params", "shard_params", "unshard_params", "reshard_params", "shard_specs",
    "hpz_remat_policy", "ParamShard",
    "accumulate_gradients", "sync", "SyncState", "ShardedSyncState", "ParamShardSyncState",
    "clip_by_global_norm",
    "codec_for_bits", "state_partition_spec", "local_params",
    "data_parallel", "DataParallel", "describe", "Description",
    "diloco", "DiLoCoState",
    "implementation", "self_test",
]
__version__ = "0.1.0"


# Names of earlier versions -> what replaces them (an AttributeError that says so).
_REMOVED = {
    "diloco_data_parallel": "qcomm.data_parallel(loss_fn, qcomm.diloco(...), mesh, axis_name=...): "
                            "the one runner; its params are the anchor",
    "diloco_params": "the params that qcomm.data_parallel(...).step returns (for diloco, the "
                     "anchor)",
    "diloco_apply_updates": "optax.apply_updates: a diloco update now moves the anchor (the "
                            "params), and the replicas' parameters live in its state",
    "diloco_partition_spec": "qcomm.state_partition_spec(opt_state), which reads each state's "
                             "own axes",
}


# Modules that lived at the package top before it was cut into layers -> their place now. Importing
# the old path raises an ImportError that names the new one (an alias would rebind ``qcomm.sync``
# and its kin, which are the public functions, to modules).
_MOVED_MODULES = {
    "wire": "native.wire", "_reference": "native._reference", "_ffi": "native._ffi",
    "_selftest": "native._selftest", "_known_answers": "native._known_answers",
    "_exchange": "transport._exchange", "axes": "transport.axes", "_varying": "transport._varying",
    "packing": "collectives.packing", "shard_layout": "collectives.shard_layout",
    "sync": "transforms.sync", "diloco": "transforms.diloco",
    "accumulation": "transforms.accumulation", "clipping": "transforms.clipping",
    "_parts": "transforms._parts", "describe": "transforms.describe", "specs": "transforms.specs",
    "data_parallel": "runners.data_parallel", "flax_nnx": "runners.flax_nnx",
    "elastic": "runners.elastic", "overlap": "runners.overlap",
}


class _MovedModuleFinder:
  """A meta path finder that answers an old module path with an error naming the new one."""

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    prefix, _, rest = fullname.partition(".")
    if prefix == __name__ and rest in _MOVED_MODULES:
      new = f"{__name__}.{_MOVED_MODULES[rest]}"
      raise ModuleNotFoundError(
          f"{fullname} moved to {new} when the package was cut into layers "
          f"(docs/architecture.md); its public names are importable as `import jax_qcomm as "
          f"qcomm; qcomm.<name>`", name=fullname)
    return None


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str):
  # The Flax NNX step loads flax: only when it is asked for.
  if name in ("nnx_data_parallel", "NNXDataParallel"):
    from jax_qcomm.runners import flax_nnx
    return getattr(flax_nnx, name)
  if name in _REMOVED:
    raise AttributeError(f"qcomm.{name} was removed; use {_REMOVED[name]}")
  raise AttributeError(f"module 'jax_qcomm' has no attribute {name!r}")
