"""The runners: the train step around a transformation. `data_parallel` (the one runner), the
Flax NNX step (:mod:`.flax_nnx`, loaded only when asked for), DiLoCo across processes that come and
go (:mod:`.elastic`) and its collective on devices of its own (:mod:`.overlap`).

The top layer of the library.
"""
