"""ResNet50 on ImageNet (tfds imagenet2012), 90 epochs, 4-bit QSGD gradients, accumulation 2.

  python -m training.train --config configs/imagenet_resnet50.py --workdir runs/r50 \
      --config.data_dir=$TFDS_DATA_DIR --config.manual_dir=$HOME/imagenet

imagenet2012 needs ILSVRC2012_img_{train,val}.tar, downloaded by hand from image-net.org into
manual_dir; without them (or data_dir's prepared copy) the trainer stops before compiling,
saying what to do (docs/training.md). A smoke test on random ImageNet-shaped batches (224x224x3,
1000 classes), about a minute on a CPU:

  python -m training.train --config configs/imagenet_resnet50.py --config.dataset=synthetic \
      --config.batch_size=4 --config.num_train_steps=2 --config.measure_sync_steps=0
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
