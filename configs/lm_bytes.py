"""The byte-level transformer LM (training/lm.py) on the CPython standard library's sources.

    python -m training.lm --config=configs/lm_bytes.py --config.bits=4
    python -m training.lm --config=configs/lm_bytes.py:quick     # the tests' quick mode

``get_config("study")`` (the default) is the size of the accuracy study (docs/accuracy.md):
8 host devices, accum_steps=2, 2000 optimizer steps. ``"quick"`` is a small model trained for 100
steps (tests/test_lm.py). Override any field on the command line: ``--config.bits=2
--config.error_feedback=True``.
"""

import ml_collections


def get_config(mode: str = "study") -> ml_collections.ConfigDict:
  if mode not in ("study", "quick"):
    raise ValueError(f"configs/lm_bytes.py takes 'study' or 'quick' after the colon, got {mode!r}")
  config = ml_collections.ConfigDict()

  # Model: pre-LayerNorm decoder-only transformer over bytes (vocabulary 256), learned positions,
  # output layer tied to the input embedding.
  config.d_model = 64
  config.num_layers = 2
  config.num_heads = 4
  config.mlp_ratio = 4
  config.seq_len = 64                # bytes of context; a window is seq_len + 1 bytes

  # Data: the running interpreter's stdlib sources (training/lm.py lists the files).
  config.stdlib_dir = ""             # "": the running interpreter's; else another stdlib folder
  config.batch_size = 32             # windows per micro-step, all devices together
  config.num_val_windows = 256       # fixed held-out windows, evenly spaced over the val split

  # Optimisation: AdamW after the synchronisation, linear warmup then cosine decay.
  config.num_steps = 2000            # optimizer steps (each = accum_steps micro-steps)
  config.learning_rate = 3e-3        # peak
  config.warmup_steps = 100
  config.end_lr_ratio = 0.1          # final learning rate / peak
  config.b1 = 0.9
  config.b2 = 0.95
  config.weight_decay = 0.1          # on matrices (kernels, embeddings) only
  config.grad_clip = 1.0             # global norm of the synchronised gradient; 0: off
  config.seed = 0                    # parameters, data order and rounding

  # Gradient synchronisation: qcomm.sync(...).
  config.bits = 32                   # 32 exact, 16 bf16 wire, 1..8 QSGD
  config.bucket_size = 128
  config.scheme = "maxmin"
  config.accum_steps = 2
  config.error_feedback = False
  config.powersgd = 0                # > 0: qcomm.PowerSGD(rank) instead of the bits codec (error
                                     # feedback then on, the codec's default)
  # The leaf policy; unset (None): the codec's default (small and 1-D leaves exact, except with
  # a sparse codec such as TopK, which sends every leaf).
  config.min_size = ml_collections.config_dict.placeholder(int)
  config.compress_1d = ml_collections.config_dict.placeholder(bool)
  config.exclude = ""                # comma-separated regexes of parameter paths sent exact
  config.shard_state = False         # sync(shard_state=True): 1/D of the optimizer state per device
  config.gather_bits = 4             # with shard_state: bits of the weight differences (QSGD)
  config.shard_params = False       # sync(shard_params=True): ZeRO-3, the parameters as 1/D shards
                                     # gathered per block inside lax.scan (training/lm.py)
  config.param_gather_bits = 8       # with shard_params: bits of the parameters' gathers (32 exact)
  config.model_devices = 1          # > 1: a ("data", "model") mesh, the weights sharded over
                                     # "model" inside each replica (tensor parallel; training/lm.py)
  config.topk = 0.0                  # training/lm_diloco: > 0 sends qcomm.TopK(topk, bits) between
                                     # the replicas (bits 1, 2, 4 or 8) instead of QSGD
  config.fragments = 1               # training/lm_diloco, lm_slow_link: qcomm.diloco(fragments=...),
                                     # 1/P of the parameters every H/P steps
  config.delay = 0                   # training/lm_diloco, lm_slow_link: qcomm.diloco(delay=...),
                                     # 1: each outer step applied one round late (--overlap)

  # Loop, logging, checkpoints.
  config.eval_every_steps = 100      # optimizer steps between val-loss points (0: only the end)
  config.log_every_steps = 50
  config.checkpoint_every_steps = 250  # with --workdir; also at the end and on a time-limit stop
  config.keep_checkpoints = 2
  config.progress_bar = True
  config.time_limit_minutes = 0.0    # >0: checkpoint and stop cleanly after this much training

  # Devices: a 'data' mesh of this many devices (on CPU, the host is split into as many).
  config.num_devices = 8

  if mode == "quick":
    config.d_model = 32
    config.num_layers = 1
    config.num_heads = 2
    config.seq_len = 32
    config.batch_size = 16           # x accum 2: 32 windows per optimizer step
    config.num_val_windows = 64
    config.num_steps = 100
    config.learning_rate = 1e-2
    config.warmup_steps = 10
    config.eval_every_steps = 50
    config.log_every_steps = 25
  return config
