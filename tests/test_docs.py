"""The documentation's runnable examples run, and do what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(path: str) -> list[str]:
  with open(os.path.join(REPO, path)) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_usage_example_trains(tmp_path):
  blocks = _python_blocks("docs/usage.md")
  assert len(blocks) == 1, "docs/usage.md should hold exactly one complete example"
  script = tmp_path / "usage_example.py"
  script.write_text(blocks[0])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  accuracy = float(re.search(r"held-out accuracy ([0-9.]+)", out.stdout).group(1))
  assert accuracy > 0.9
  losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out.stdout)]
  assert losses[-1] < losses[0] / 3
