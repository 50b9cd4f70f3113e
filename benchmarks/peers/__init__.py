"""PyTorch peers of jax_qcomm on the same simulated links (:mod:`benchmarks.peers.torch_worker`).

Run by a separate Python 3.11 venv that has torch (the ``peers`` extra is not installable into the
project's Python >= 3.12 venv on this machine); the library, the trainer and the tests never import
this package. This ``__init__`` imports nothing.
"""
