"""The gradient payloads of the peers benchmark: names and shapes of the leaves, in order.

* ``resnet50``: the 161 parameters of ``training.models.ResNet50`` (1000 classes; 25,557,032
  values), read with ``jax.eval_shape`` of its ``init`` (no weights computed) and written in
  PyTorch's layout, so that torch's DDP buckets and PowerSGD's matrices are those of a torchvision
  ResNet50: convolution kernels HWIO -> OIHW, the dense kernel (in, out) -> (out, in);
* ``gpt2_125m``: GPT-2 small as Hugging Face lists its 148 parameters (12 layers, d = 768, vocab
  50257, 1024 positions, tied output embedding; 124,439,808 values), Conv1D weights (in, out);
* ``gpt2:<layers>x<d>x<vocab>``: the same structure at another size (positions = 4 d), e.g.
  ``gpt2:2x256x2048`` (2.2M values, 28 leaves) for quick runs;
* ``flat:<n>``: one float32 buffer of n values.

The order is the forward order, as torch registers a model's parameters (ResNet50: stem, blocks
0-15 each conv/norm 0-2 then the projection, dense last; weight before bias): both frameworks get
the same list, and DDP buckets it in reverse as it does a model's.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp

from benchmarks.peers import data

Leaves = list[tuple[str, tuple[int, ...]]]
NAMES = ("resnet50", "gpt2_125m")
RESNET50_PARAMS = 25_557_032
GPT2_SMALL_PARAMS = 124_439_808


def gpt2_small(layers: int = 12, d: int = 768, vocab: int = 50257, positions: int = 1024) -> Leaves:
  """GPT-2 small's parameters (Hugging Face names and shapes)."""
  leaves: Leaves = [("wte.weight", (vocab, d)), ("wpe.weight", (positions, d))]
  for i in range(layers):
    h = f"h.{i}"
    leaves += [(f"{h}.ln_1.weight", (d,)), (f"{h}.ln_1.bias", (d,)),
               (f"{h}.attn.c_attn.weight", (d, 3 * d)), (f"{h}.attn.c_attn.bias", (3 * d,)),
               (f"{h}.attn.c_proj.weight", (d, d)), (f"{h}.attn.c_proj.bias", (d,)),
               (f"{h}.ln_2.weight", (d,)), (f"{h}.ln_2.bias", (d,)),
               (f"{h}.mlp.c_fc.weight", (d, 4 * d)), (f"{h}.mlp.c_fc.bias", (4 * d,)),
               (f"{h}.mlp.c_proj.weight", (4 * d, d)), (f"{h}.mlp.c_proj.bias", (d,))]
  leaves += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
  return leaves


def to_torch_layout(name: str, shape: Sequence[int]) -> tuple[int, ...]:
  """A flax parameter's shape in PyTorch's layout: conv HWIO -> OIHW, dense (in, out) -> (out, in)."""
  shape = tuple(int(s) for s in shape)
  if len(shape) == 4:
    h, w, i, o = shape
    return (o, i, h, w)
  if len(shape) == 2:
    return (shape[1], shape[0])
  return shape


def flax_to_torch(array):
  """The array of a flax parameter transposed to :func:`to_torch_layout` (numpy or jax)."""
  if array.ndim == 4:
    return array.transpose(3, 2, 0, 1)
  if array.ndim == 2:
    return array.T
  return array


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def resnet50_flax_params(num_classes: int = 1000):
  """(model, abstract variables) of ``training.models.ResNet50`` (ImageNet stem)."""
  from training import models  # noqa: PLC0415  (flax, ~1 s: only the resnet50 payload needs it)

  model = models.ResNet50(num_classes=num_classes)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)),
                                                train=False))
  return model, variables


def _forward_order(name: str) -> tuple[int, int, int]:
  """Sort key putting flax's (alphabetical) ResNet parameter paths in forward order."""
  top, *mid, leaf = name.split("/")
  m = re.fullmatch(r"BottleneckResNetBlock_([0-9]+)", top)
  first = 0 if top == "conv_init" else 1 if top == "bn_init" else 2 + int(m.group(1)) if m else 10**6
  second = 0
  if mid:
    k = re.fullmatch(r"(Conv|BatchNorm)_([0-9]+)", mid[0])
    second = (2 * int(k.group(2)) + (k.group(1) == "BatchNorm") if k
              else 100 + (mid[0] == "norm_proj"))
  return first, second, 0 if leaf in ("kernel", "scale") else 1


def resnet50() -> Leaves:
  """ResNet50's parameters in forward order, names like ``BottleneckResNetBlock_0/Conv_0/kernel``,
  shapes in PyTorch's layout."""
  _, variables = resnet50_flax_params()
  flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
  named = [(_path_name(path), to_torch_layout(_path_name(path), leaf.shape)) for path, leaf in flat]
  return sorted(named, key=lambda item: _forward_order(item[0]))


def leaves(name: str) -> Leaves:
  """The leaves of payload ``name`` (see the module docstring)."""
  if name == "resnet50":
    return resnet50()
  if name == "gpt2_125m":
    return gpt2_small()
  m = _GPT2.fullmatch(name)
  if m:
    layers, d, vocab = (int(v) for v in m.groups())
    return gpt2_small(layers, d, vocab, positions=4 * d)
  m = _FLAT.fullmatch(name)
  if m:
    return [("flat", (int(m.group(1)),))]
  raise ValueError(_BAD.format(name=name))


_GPT2 = re.compile(r"gpt2:([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)")
_FLAT = re.compile(r"flat:([1-9][0-9]*)")
_BAD = ("payload must be one of " + ", ".join(NAMES) + ", gpt2:<layers>x<d>x<vocab> or flat:<n>, "
        "got {name!r}")


def check_name(name: str) -> str:
  """argparse type: a payload name (checked without building ResNet50)."""
  if name in NAMES or _GPT2.fullmatch(name) or _FLAT.fullmatch(name):
    return name
  raise argparse.ArgumentTypeError(_BAD.format(name=name))


def is_flat(name: str) -> bool:
  """Whether the payload is one buffer (reduced as a bare array, not a one-leaf pytree)."""
  return bool(_FLAT.fullmatch(name))


def spec(name: str, gradients: str | None = None) -> dict:
  """The spec of payload ``name`` (:func:`benchmarks.peers.data.make_spec`)."""
  return data.make_spec(name, leaves(name), gradients)


def count(leaf_list: Leaves) -> int:
  return sum(math.prod(s) for _, s in leaf_list)
