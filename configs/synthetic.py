"""Throughput: ResNet50 on synthetic 224x224 data (no input pipeline cost), a few hundred steps,
no evaluation. Compare --config.bits=32 / 16 / 4 and --config.accum_steps=1 / 2."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = "synthetic"
  config.batch_size = 256
  config.num_train_steps = 200
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.keep_checkpoints = 0
  config.log_every_steps = 20
  config.measure_sync_steps = 20
  return config
