"""Prints the requirements of jax_qcomm (its build requirements, dependencies and the given
extras, self-references expanded) from pyproject.toml, one per line, for ``pip install -r``.

    python scripts/requirements.py test        # what scripts/bootstrap.sh installs

pyproject.toml stays the one list of dependencies; bootstrap installs them with build isolation
and then builds the project itself without (see scripts/bootstrap.sh).
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib


def requirements(extras: list[str], pyproject: pathlib.Path) -> list[str]:
  meta = tomllib.loads(pyproject.read_text())
  name = meta["project"]["name"]
  optional = meta["project"].get("optional-dependencies", {})
  out = list(meta["build-system"]["requires"]) + ["cmake", "ninja"] + list(meta["project"]["dependencies"])
  todo, seen = list(extras), set()
  while todo:
    extra = todo.pop()
    if extra in seen:
      continue
    if extra not in optional:
      raise SystemExit(f"unknown extra {extra!r}; pyproject.toml has {sorted(optional)}")
    seen.add(extra)
    for req in optional[extra]:
      m = re.fullmatch(rf"{re.escape(name)}\[([^\]]*)\]", req.replace(" ", ""))
      if m:  # "jax_qcomm[train,notebooks]": pull those extras in instead
        todo.extend(e for e in m.group(1).split(",") if e)
      else:
        out.append(req)
  return list(dict.fromkeys(out))


if __name__ == "__main__":
  root = pathlib.Path(__file__).resolve().parent.parent
  extras = [e for arg in sys.argv[1:] for e in arg.split(",") if e]
  print("\n".join(requirements(extras, root / "pyproject.toml")))
