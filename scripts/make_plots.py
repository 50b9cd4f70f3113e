"""Regenerates every figure in docs/img from the recorded data in notebooks/data by executing
the notebooks in place (full mode), as tests/test_notebooks.py does in fast mode.

    .venv/bin/python scripts/make_plots.py [efficiency.ipynb compression.ipynb]
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

import nbclient
import nbformat

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> None:
  path = NOTEBOOKS / name
  nb = nbformat.read(path, as_version=4)
  # The kernel must run this interpreter's environment: no user kernel spec may shadow python3.
  with tempfile.TemporaryDirectory() as data_dir:
    os.environ["JUPYTER_DATA_DIR"] = data_dir
    os.environ.pop("QCOMM_NOTEBOOK_FAST", None)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=3600,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
  nbformat.write(nb, path)
  print(f"executed {path} (figures saved under docs/img)")


if __name__ == "__main__":
  for name in sys.argv[1:] or ["efficiency.ipynb", "compression.ipynb"]:
    execute(name)
