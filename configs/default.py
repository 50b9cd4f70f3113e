"""Defaults shared by every config: the ImageNet ResNet50 recipe (flax examples/imagenet) with
jax_qcomm's gradient synchronisation. Other configs start from here and change what differs."""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Model.
  config.model = "ResNet50"          # ResNetMini, ResNet18, ResNet34, ResNet50, ResNet101
  config.num_filters = 64
  config.stem = "imagenet"           # "imagenet" (7x7/2 + max-pool) or "small" (3x3/1)
  config.half_precision = False      # bf16 compute (parameters and gradients stay float32)

  # Data.
  config.dataset = "imagenet2012"    # imagenet2012, image_folder, digits, synthetic
  config.data_dir = ""               # tfds data_dir (imagenet2012) or the image folder root
  config.manual_dir = ""             # where ILSVRC2012_img_{train,val}.tar were downloaded
                                     # (default: <tfds data_dir>/downloads/manual)
  config.train_split = "train"
  config.eval_split = "validation"
  config.image_size = 224
  config.num_classes = 1000          # used by the synthetic dataset only
  config.synthetic_examples = 1_281_167
  config.shuffle_buffer = 16 * 1024
  config.seed = 0

  # Optimisation. batch_size is the global batch of one call of the train step (all devices);
  # an optimizer step sees batch_size * accum_steps examples, and the learning rate scales with it.
  config.batch_size = 512
  config.learning_rate = 0.1         # per 256 examples of an optimizer step
  config.momentum = 0.9
  config.nesterov = True
  config.weight_decay = 1e-4         # on convolution and dense kernels only
  config.label_smoothing = 0.0
  config.warmup_epochs = 5.0
  config.num_epochs = 90.0
  config.num_train_steps = -1        # optimizer steps; -1: num_epochs worth

  # Gradient synchronisation: qcomm.sync(...).
  config.bits = 4                    # 32 exact, 16 Wire16 fields, 1..8 the fastest codec (Auto)
  config.bucket_size = 128
  config.scheme = "maxmin"
  config.accum_steps = 2
  config.error_feedback = False
  config.min_size = 1024             # leaves smaller than this are sent exact
  config.compress_1d = False         # biases and BatchNorm scales exact
  config.exclude = ""                # comma-separated regexes of parameter paths sent exact
  config.comm_bucket_size = config_dict.placeholder(int)  # None: the codec's own buffer size

  # Loop, logging, checkpoints.
  config.eval_every_steps = 5000     # optimizer steps; 0: only at the end
  config.log_every_steps = 100
  config.checkpoint_every_steps = 5000
  config.keep_checkpoints = 3
  config.progress_bar = True
  config.measure_sync_steps = 10     # timed calls with and without synchronisation (0: skip)

  # Devices and processes.
  config.num_cpu_devices = 0         # >0: split the host CPU into this many JAX devices
  config.coordinator_address = ""    # jax.distributed: explicit host:port (else auto-detected
  config.num_processes = 0           # under SLURM / Open MPI, or from jax_qcomm.tools.launch)
  config.process_id = -1
  config.gloo_interface = ""         # CPU multi-process: network interface for gloo
  return config
