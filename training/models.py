"""ResNet v1.5 in Flax (linen), as in flax's ``examples/imagenet/models.py``.

Differences from that example, each for a reason:

* ``bn_axis_name``: BatchNorm statistics are averaged over the data-parallel mesh axis inside
  ``shard_map`` (cross-device BatchNorm), so every replica normalises with the global batch's
  statistics and the running averages stay identical on all devices.
* ``stem="small"``: a 3x3 stride-1 stem without max-pooling, for the 8x8 images of the embedded
  default (the ImageNet stem would reduce them to 2x2 before the first block).
* ``ResNetMini``: a three-stage, two-block ResNet that trains on the embedded dataset in seconds.

Inputs are NHWC float32 images; outputs are float32 logits ``[batch, num_classes]``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class ResNetBlock(nn.Module):
  """Basic block (two 3x3 convolutions): ResNet-18/34."""
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.act(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class BottleneckResNetBlock(nn.Module):
  """Bottleneck block (1x1, 3x3 with the stride, 1x1 x4): ResNet-50/101."""
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (1, 1))(x)
    y = self.act(self.norm()(y))
    y = self.conv(self.filters, (3, 3), self.strides)(y)
    y = self.act(self.norm()(y))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNet v1.5 (stride in the 3x3 convolution).

  Attributes:
    stage_sizes: blocks per stage.
    block_cls: ``ResNetBlock`` or ``BottleneckResNetBlock``.
    num_classes: size of the logits.
    num_filters: channels of the first stage (doubled per stage).
    dtype: compute dtype (``jnp.bfloat16`` for bf16 compute; parameters stay float32).
    bn_axis_name: mesh axis over which BatchNorm averages its batch statistics (None: local).
    stem: ``"imagenet"`` (7x7/2 convolution + 3x3/2 max-pool) or ``"small"`` (3x3/1, no pool).
  """
  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  bn_axis_name: str | None = None
  stem: str = "imagenet"

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype, axis_name=self.bn_axis_name)
    x = x.astype(self.dtype)
    if self.stem == "imagenet":
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = self.act(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    elif self.stem == "small":
      x = conv(self.num_filters, (3, 3), name="conv_init")(x)
      x = self.act(norm(name="bn_init")(x))
    else:
      raise ValueError(f"stem must be 'imagenet' or 'small', got {self.stem!r}")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm,
                           act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, jnp.float32)


ResNetMini = functools.partial(ResNet, stage_sizes=[2, 2, 2], block_cls=ResNetBlock)
ResNet18 = functools.partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=ResNetBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)
ResNet101 = functools.partial(ResNet, stage_sizes=[3, 4, 23, 3], block_cls=BottleneckResNetBlock)

MODELS = {"ResNetMini": ResNetMini, "ResNet18": ResNet18, "ResNet34": ResNet34,
          "ResNet50": ResNet50, "ResNet101": ResNet101}


def create_model(name: str, *, num_classes: int, num_filters: int = 64, half_precision: bool = False,
                 bn_axis_name: str | None = None, stem: str = "imagenet") -> nn.Module:
  """The model called ``name`` (a key of :data:`MODELS`)."""
  if name not in MODELS:
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
  return MODELS[name](num_classes=num_classes, num_filters=num_filters,
                      dtype=jnp.bfloat16 if half_precision else jnp.float32,
                      bn_axis_name=bn_axis_name, stem=stem)
