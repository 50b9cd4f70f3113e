"""jax_qcomm: compressed gradient collectives for JAX.

Codecs (:class:`Codec`: QSGD and Summable as XLA FFI kernels -- C++ on CPU, CUDA on NVIDIA GPUs --
with a pure-JAX reference of the same wire format; Cast; NoCompression), each reducing across
devices through one protocol, the collectives built on it (inside ``jax.shard_map`` /
``jax.pmap``) and the optax wrapper :func:`sync`.
The tooling above the library -- the cost model and the multi-process runtime -- is imported on its
own: ``from jax_qcomm.tools import efficiency, distributed`` (this module never imports it).
"""

from jax_qcomm import _ffi
from jax_qcomm._selftest import implementation, self_test
from jax_qcomm import transport
from jax_qcomm.codecs import (QSGD, Auto, Cast, Codec, NoCompression, PowerSGD, Summable, TopK,
                              Wire16, codec_for_bits)
from jax_qcomm.axes import Hierarchical
from jax_qcomm.collectives import all_gather, allreduce, cast_pmean, reduce_scatter
from jax_qcomm.packing import LeafPolicy
from jax_qcomm.accumulation import accumulate_gradients
from jax_qcomm.sync import ShardedSyncState, SyncState, sync
from jax_qcomm.specs import local_params, state_partition_spec
from jax_qcomm.clipping import clip_by_global_norm
from jax_qcomm.data_parallel import DataParallel, data_parallel
from jax_qcomm.describe import Description, describe
from jax_qcomm.diloco import DiLoCoState, diloco

_ffi.register()

__all__ = [
    "QSGD", "Auto", "Cast", "Codec", "NoCompression", "Summable", "Wire16", "TopK", "PowerSGD",
    "transport",
    "Hierarchical", "LeafPolicy", "allreduce", "reduce_scatter", "all_gather", "cast_pmean",
    "accumulate_gradients", "sync", "SyncState", "ShardedSyncState", "clip_by_global_norm",
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


def __getattr__(name: str):
  # The Flax NNX step loads flax: only when it is asked for.
  if name in ("nnx_data_parallel", "NNXDataParallel"):
    from jax_qcomm import flax_nnx
    return getattr(flax_nnx, name)
  if name in _REMOVED:
    raise AttributeError(f"qcomm.{name} was removed; use {_REMOVED[name]}")
  raise AttributeError(f"module 'jax_qcomm' has no attribute {name!r}")
