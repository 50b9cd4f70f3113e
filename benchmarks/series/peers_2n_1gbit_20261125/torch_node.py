import os, sys
env = dict(os.environ, PYTHONPATH="/tmp/peers")
args = ["/tmp/venv-torch/bin/python", "-m", "benchmarks.peers.torch_worker", "--spec", "/tmp/peers/resnet50_spec.json",
        "--methods", "allreduce_fp32", "ddp_fp32", "ddp_fp16", "ddp_powersgd1", "ddp_powersgd4",
        "--repeats", "5", "--warmup", "1", "--link-gbps", "1", "--out", "/tmp/peers/torch_out.json"]
os.chdir("/tmp/peers")
os.execve(args[0], args, env)
