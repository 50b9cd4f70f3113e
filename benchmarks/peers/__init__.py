"""Peers on the same simulated links: PyTorch's gloo allreduce and DDP compression hooks beside
jax_qcomm's collectives (``python -m benchmarks peers``, :mod:`benchmarks.peers.run`).

* :mod:`benchmarks.peers.payloads` -- the gradient payloads: ResNet50's 161 leaves, a 125M GPT-2
  small, or one flat buffer (leaf names and shapes, in PyTorch's layout);
* :mod:`benchmarks.peers.data` -- numpy only: the inputs every rank reduces, the exact mean, the
  relative error and the wire-byte accounting, shared by both sides;
* :mod:`benchmarks.peers.torch_worker` -- the PyTorch side, run by a Python 3.11 venv with torch
  (``benchmarks/peers/setup_torch.sh`` makes ``.venv-torch``); torch is never needed by the library,
  the trainer or the tests;
* :mod:`benchmarks.peers.make_gradients` -- a real ResNet50 gradient per rank, saved once to an npz;
* :mod:`benchmarks.peers.run` -- builds one cluster and runs both sides in it.

This package's ``__init__`` imports nothing: the torch venv imports its numpy-only modules.
"""
