"""The embedded default: a small ResNet on scikit-learn's digits (8x8 grey images shipped inside
the scikit-learn wheel) over 8 host CPU devices. Trains to > 90% held-out accuracy in about a
minute on 2 cores; `python -m training.embedded` runs it at 32 and 4 bits side by side."""

from configs import default


def get_config():
  config = default.get_config()
  config.model = "ResNetMini"
  config.num_filters = 16
  config.stem = "small"
  config.dataset = "digits"
  # The documented usage: sync(bits=..., accum_steps=2). 64 images a call x 2 calls = a 128-image
  # optimizer step, as before accumulation was on (same steps, same learning rate).
  config.batch_size = 64
  config.learning_rate = 0.2         # per 256: 0.1 for a 128-example optimizer step
  config.weight_decay = 5e-4
  config.warmup_epochs = 2.0
  config.num_epochs = 12.0
  config.bits = 4
  config.bucket_size = 128
  config.accum_steps = 2
  config.min_size = 256              # the model is small: compress all but the tiniest leaves
  config.eval_every_steps = 100
  config.log_every_steps = 20
  config.checkpoint_every_steps = 0  # 0: only at the end
  config.keep_checkpoints = 1
  config.measure_sync_steps = 20
  config.num_cpu_devices = 8
  return config
