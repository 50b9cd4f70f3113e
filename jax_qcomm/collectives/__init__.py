"""Collectives of pytrees: the leaf policy and the packing of a pytree into flat communication
buffers (:mod:`.packing`), the per-leaf shards of the sharded mode (:mod:`.shard_layout`), and the
public compressed collectives (:mod:`.ops`: ``allreduce``, ``reduce_scatter``, ``all_gather``,
``cast_pmean``), called inside ``jax.shard_map`` or ``jax.pmap``.

Above the codecs, below the optax transformations.
"""

from jax_qcomm.collectives.ops import (all_gather, allreduce, allreduce_flat,  # noqa: F401
                                       allreduce_tree, cast_pmean, fresh_state_key,
                                       init_codec_state, reduce_scatter)
from jax_qcomm.collectives.sharded_params import (ParamShard, gather_params,  # noqa: F401
                                                  hpz_remat_policy, reshard_params,
                                                  shard_params, shard_specs, unshard_params)
