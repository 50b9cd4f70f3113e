"""The documentation's code runs, and does what it says.

docs/usage.md is written as one script in several blocks (later blocks use the names of earlier
ones): every ```python block runs, in order, in one fresh process. The README's example runs the
same way, as a standalone script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(path: str) -> list[str]:
  with open(os.path.join(REPO, path)) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_usage_md_runs_every_block(tmp_path):
  blocks = _python_blocks("docs/usage.md")
  assert len(blocks) >= 8, "docs/usage.md lost its examples"
  script = "".join(f"print('### block {i}', flush=True)\n{b}\n" for i, b in enumerate(blocks))
  (tmp_path / "usage.py").write_text(script)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "usage.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
  done = re.findall(r"### block (\d+)", out.stdout)
  where = f"failed in block {done[-1] if done else '?'} of {len(blocks)}\n"
  assert out.returncode == 0, where + out.stdout[-3000:] + out.stderr[-4000:]
  assert len(done) == len(blocks)
  # the first example trains: high accuracy, loss down by 3x
  accuracy = float(re.search(r"held-out accuracy ([0-9.]+)", out.stdout).group(1))
  assert accuracy > 0.9
  first = out.stdout.split("### block 1")[0]
  losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", first)]
  assert losses[-1] < losses[0] / 3, losses
  # describe prints its table
  assert "sent B/device/sync" in out.stdout and "exact fp32" in out.stdout


def test_readme_example_runs(tmp_path):
  """The README's example runs as a standalone script in a fresh process: it trains (the loss
  falls) and describe prints its table, the weight at 4 bits."""
  blocks = _python_blocks("README.md")
  assert blocks, "README.md lost its example"
  (tmp_path / "readme.py").write_text("\n".join(blocks))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
  losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", out.stdout)]
  assert len(losses) >= 2 and losses[-1] < losses[0] / 3, losses
  assert "8 devices" in out.stdout and "sent B/device/sync" in out.stdout, out.stdout[-3000:]
  assert re.search(r"^w\s.*QSGD 4b", out.stdout, flags=re.M), out.stdout[-3000:]
