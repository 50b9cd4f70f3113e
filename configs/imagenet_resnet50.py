"""ResNet50 on ImageNet (tfds imagenet2012), 90 epochs, 4-bit QSGD gradients, accumulation 2.

  python -m training.train --config configs/imagenet_resnet50.py --workdir runs/r50 \
      --config.data_dir=$TFDS_DATA_DIR --config.manual_dir=$HOME/imagenet
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model = "ResNet50"
  config.dataset = "imagenet2012"
  config.batch_size = 512            # x accum_steps 2 = 1024 per optimizer step, lr 0.4
  config.half_precision = True
  config.bits = 4
  config.accum_steps = 2
  config.num_epochs = 90.0
  return config
