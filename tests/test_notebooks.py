"""The notebooks execute (fast mode, QCOMM_NOTEBOOK_FAST=1) and produce their key outputs.

Run with nbclient on the ``python3`` kernel: with ipykernel installed, jupyter_client always finds
that native kernel spec (the environment's own ``share/jupyter/kernels/python3`` or ipykernel's
built-in one) and runs its ``python`` command with this interpreter (``sys.executable``), so the
kernel sees the same environment (jax, jax_qcomm) as the tests. A kernel spec of the same name in
the user's Jupyter data directory would take precedence, so that directory is pointed at an empty
temporary one.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def _execute(name: str, monkeypatch, tmp_path) -> str:
  """Executes notebooks/<name> in fast mode; returns all its text outputs joined."""
  monkeypatch.setenv("QCOMM_NOTEBOOK_FAST", "1")
  monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
  monkeypatch.delenv("JUPYTER_PATH", raising=False)
  for var in ("XLA_FLAGS", "QCOMM_NUM_PROCESSES", "QCOMM_COORDINATOR", "QCOMM_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()  # raises CellExecutionError on any failing cell
  texts = []
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    for out in cell.get("outputs", []):
      assert out.get("output_type") != "error", out
      if out.get("output_type") == "stream":
        texts.append(out.get("text", ""))
      elif "data" in out and "text/plain" in out["data"]:
        texts.append(out["data"]["text/plain"])
  return "\n".join(texts)


def test_efficiency_notebook(monkeypatch, tmp_path):
  text = _execute("efficiency.ipynb", monkeypatch, tmp_path)
  assert "FAST=True" in text
  # section 7: the cost model's check against the recorded cluster runs (notebooks/data/model_check.json)
  assert re.search(r"MODEL_CHECK \d+/\d+ points within 15%", text)
  # the model reproduces the published 4-node 10 GbE recipe (68.8 -> 81.5 -> 89.8 -> 94.5 %)
  for label, published in (("bf16 wire", 0.815), ("bf16 + accum 2 ", 0.898)):
    m = re.search(re.escape(label) + r"\s+([0-9.]+)\s+([0-9.]+)", text)
    assert m, label
    assert float(m.group(1)) == pytest.approx(published)
    assert float(m.group(2)) == pytest.approx(published, abs=0.01)
  assert "MODEL_ETA at 1 Gbit/s" in text
  # a measured step is shown against the model (cluster file or loopback sample)
  assert re.search(r"(cluster|sample)_step", text) and "model Tstep" in text
  assert re.search(r"(cluster|sample)_allreduce", text)


def test_compression_notebook(monkeypatch, tmp_path):
  pytest.importorskip("sklearn")
  text = _execute("compression.ipynb", monkeypatch, tmp_path)
  assert "FAST=True" in text and "devices=8" in text
  assert "relative L2 error of one QSGD roundtrip" in text
  m = re.search(r"ACCURACY_BY_BITS (\{.*\})", text)
  assert m, text[-2000:]
  acc = ast.literal_eval(m.group(1))
  assert set(acc) == {32, 16, 8, 4, 2}
  # a few epochs of digits already reach well above chance (10%) at every width
  assert acc[32] > 0.8 and acc[16] > 0.8 and acc[4] > 0.7 and acc[2] > 0.3, acc
