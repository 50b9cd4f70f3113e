"""The package's layering, kept: the library is cut into folders, one a layer; a module imports only
modules of its own or lower layers, the import graph has no cycles, and ``import jax_qcomm`` loads
no tooling and changes nothing in JAX.

The layers (docs/architecture.md), lowest first::

    _checks, _compat (the package top)  ->  native/  ->  transport/  ->  codecs/
    ->  collectives/  ->  transforms/  ->  runners/  ->  jax_qcomm/__init__.py (the public API)

``runners/flax_nnx`` is the one module that imports flax, loaded only when
``qcomm.nnx_data_parallel`` is asked for. ``jax_qcomm.tools`` (the cost model ``efficiency``, the
multi-process runtime ``distributed`` and ``launch``, the simulated cluster ``cluster``) sits above
the library: its modules may import the library and each other, and nothing in the library imports
them. Tooling outside the package (``benchmarks/``, ``training/``, ``configs/``) may import the
library and the tools; the library never imports it.

The graph is read from the sources with ``ast`` (function-local imports count: they are dependencies
too), so a violation fails here before it can hide behind an import order.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "jax_qcomm"

#: Lowest first: the package top's two foundation modules, then one folder a layer. A module may
#: import modules of its own layer or of a lower one.
LAYERS: list[str] = [
    "_base",        # _checks, _compat: argument checks, jax-version differences
    "native",       # the wire format, the pure-JAX reference, the FFI binding, the self-test
    "transport",    # axes, exchange schedules, per-device checks, the transport's cost model
    "codecs",       # the Codec protocol and its implementations
    "collectives",  # pytrees <-> flat buffers, shard layouts, allreduce / reduce_scatter / all_gather
    "transforms",   # the optax transformations: sync, diloco, accumulation, clipping, describe
    "runners",      # the train steps: data_parallel, NNX, elastic, overlap
    "__init__",     # the public API
]
#: Modules of the package top and the layer they belong to.
TOP = {"_checks": "_base", "_compat": "_base", "__init__": "__init__"}
#: The tooling subpackage (jax_qcomm/tools): above the library, never imported by it.
TOOLS = "tools"
#: Compiled extension modules (built by CMake; the binding layer loads them).
EXTENSIONS = {"_qcomm_cpu", "_qcomm_cuda"}
#: Most lines a library module may have.
MAX_LINES = 800
#: Packages outside jax_qcomm that the library must never import (tooling, optional extras).
NEVER_IN_LIBRARY = {"benchmarks", "training", "configs", "matplotlib", "flax", "tensorflow",
                    "tensorflow_datasets", "orbax", "nbclient", "pytest", "torch"}
#: The one module allowed to reach jax's private modules (jax._src, jaxlib._jax): _compat, for the
#: gloo-on-an-interface registration (its GLOO_PRIVATE_NAMES; tests/test_faults.py checks them).
JAX_PRIVATE_ALLOWED = {"_compat"}
#: Library modules allowed one optional framework each, never loaded by ``import jax_qcomm``.
OPTIONAL_FRAMEWORK = {"runners.flax_nnx": {"flax"}}
_PRIVATE_PREFIXES = ("jax._src", "jaxlib._")


def _package_dir(package: str) -> pathlib.Path:
  return ROOT.joinpath(*package.split("."))


def _modules(package: str) -> dict[str, pathlib.Path]:
  """The modules of a package (dotted: ``jax_qcomm.tools``), its own __init__ included."""
  return {p.stem: p for p in sorted(_package_dir(package).glob("*.py"))}


def _resolve(dotted: list[str]) -> str | None:
  """The module (dotted, relative to the package) that an import of ``jax_qcomm.<dotted>`` loads;
  a folder's ``__init__`` as ``folder.__init__``."""
  path = _package_dir(PACKAGE).joinpath(*dotted)
  if path.with_suffix(".py").exists():
    return ".".join(dotted)
  if (path / "__init__.py").exists():
    return ".".join(dotted + ["__init__"])
  return None


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """(modules of jax_qcomm that `path` imports, dotted relative to the package (``codecs.base``,
  ``transport.__init__``, ``__init__`` for the package itself), other top-level packages it
  imports)."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  inside, outside = set(), set()

  def add(name: str, names: list[str] = ()) -> None:
    parts = name.split(".")
    if parts[0] != PACKAGE:
      outside.add(parts[0] if parts[0] != "jax" or len(parts) < 2 else ".".join(parts[:2]))
      return
    rest = parts[1:]
    # every package on the way is imported too (its __init__ runs)
    for k in range(len(rest)):
      if (found := _resolve(rest[:k])) and found.endswith("__init__") and k:
        inside.add(found)
    submodules = {found for n in names if (found := _resolve(rest + [n]))}
    inside.update(submodules)
    submodules |= set(names) & EXTENSIONS  # from jax_qcomm.x import y: y may be a submodule
    if rest and (found := _resolve(rest)):
      if not found.endswith("__init__") or len(submodules) < len(names) or not names:
        inside.add(found)
    elif not rest and (len(submodules) < len(names) or not names):
      inside.add("__init__")  # names defined by the package's __init__ itself

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.module:
      assert not node.level, f"{path}: relative import (the package writes them absolute)"
      add(node.module, [a.name for a in node.names])
  return inside - {f"{e}" for e in EXTENSIONS}, outside


def _library_modules() -> dict[str, pathlib.Path]:
  """Every library module, dotted relative to the package (``codecs.base``, ``_checks``)."""
  out = {name: path for name, path in _modules(PACKAGE).items()}
  for sub in LAYERS:
    if _package_dir(f"{PACKAGE}.{sub}").is_dir():
      out.update({f"{sub}.{k}": v for k, v in _modules(f"{PACKAGE}.{sub}").items()})
  return out


def _layer_of(module: str) -> str | None:
  head = module.split(".")[0]
  if "." not in module:
    return TOP.get(module)
  return head if head in LAYERS else None


def _graph() -> dict[str, set[str]]:
  """library module -> the library modules it imports (its own folder's ``__init__`` aside: that
  one has run by the time any module of the folder runs)."""
  return {name: _imports(path)[0] - {name, name.rsplit(".", 1)[0] + ".__init__"}
          for name, path in _library_modules().items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of the graph (as a path) or None."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_every_module_has_a_place():
  top = {p.stem for p in (ROOT / PACKAGE).glob("*.py")}
  assert top == set(TOP), (
      f"modules at the package top other than {sorted(TOP)}: {sorted(top - set(TOP))} (a module "
      f"belongs in the folder of its layer; docs/architecture.md)")
  folders = {p.name for p in (ROOT / PACKAGE).iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
  expected = {TOOLS} | {layer for layer in LAYERS if layer not in ("_base", "__init__")}
  assert folders == expected, f"subpackages other than {expected}: {folders ^ expected}"
  for name in _library_modules():
    assert _layer_of(name), f"{name} has no layer"


def test_no_module_imports_upward():
  rank = {layer: i for i, layer in enumerate(LAYERS)}
  bad = []
  for module, deps in _graph().items():
    for dep in deps:
      if dep.split(".")[0] == TOOLS:
        bad.append(f"{module} -> {PACKAGE}.{dep} (the library never imports its tooling)")
      elif rank[_layer_of(dep)] > rank[_layer_of(module)]:
        bad.append(f"{module} ({_layer_of(module)}) -> {dep} ({_layer_of(dep)})")
  assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_library_module_is_too_long():
  long = {name: n for name, path in _library_modules().items()
          if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


def test_old_module_paths_name_their_new_place():
  import importlib
  import jax_qcomm
  for old, new in jax_qcomm._MOVED_MODULES.items():
    assert _resolve(new.split(".")), f"{new} does not exist"
    with pytest.raises(ModuleNotFoundError, match=f"jax_qcomm.{new}"):
      importlib.import_module(f"jax_qcomm.{old}")
  # the public functions of the same names are untouched by the finder
  assert callable(jax_qcomm.sync) and callable(jax_qcomm.describe)
  from jax_qcomm import sync, diloco  # noqa: F401
  assert sync is jax_qcomm.sync


def test_tools_import_only_the_library_and_each_other():
  """The tools are a layer above the public API: they may use any library module (the foundations
  included) and each other, nothing else of the package."""
  library = set(_library_modules())
  for name, path in _modules(f"{PACKAGE}.{TOOLS}").items():
    inside, _ = _imports(path)
    assert all(m in library or m.split(".")[0] == TOOLS for m in inside), (name, inside)


def test_no_import_cycles_in_the_library():
  cycle = _cycle(_graph())
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def _flat_imports(path: pathlib.Path, package: str) -> tuple[set[str], set[str]]:
  """(modules of the flat package `package` that `path` imports, other top-level packages)."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  inside, outside = set(), set()
  prefix = package.split(".")
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [(a.name, []) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [(node.module, [a.name for a in node.names])]
    for name, froms in names:
      parts = name.split(".")
      if parts[:len(prefix)] != prefix:
        outside.add(parts[0])
      elif len(parts) > len(prefix):
        inside.add(parts[len(prefix)])
      else:
        inside.update(n for n in froms if (_package_dir(package) / f"{n}.py").exists())
  return inside, outside


@pytest.mark.parametrize("package", [f"{PACKAGE}.{TOOLS}", "benchmarks"])
def test_no_import_cycles_in_the_tooling(package):
  graph = {name: _flat_imports(path, package)[0] - {name}
           for name, path in _modules(package).items()}
  cycle = _cycle(graph)
  assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_library_imports_no_tooling_and_no_jax_internals():
  bad = []
  modules = {**_library_modules(),
             **{f"{TOOLS}.{k}": v for k, v in _modules(f"{PACKAGE}.{TOOLS}").items()}}
  for name, path in modules.items():
    outside = _imports(path)[1]
    bad += [f"{name} imports {o}"
            for o in outside & NEVER_IN_LIBRARY - OPTIONAL_FRAMEWORK.get(name, set())]
    if name in JAX_PRIVATE_ALLOWED:
      continue
    # import statements, and module names handed to importlib as strings
    strings = {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    private = {o for o in outside if o.startswith(_PRIVATE_PREFIXES)}
    private |= {s for s in strings if s.startswith(_PRIVATE_PREFIXES) and " " not in s}
    if private:
      bad.append(f"{name} reaches {sorted(private)} (jax-version differences belong in "
                 f"jax_qcomm/_compat.py)")
  assert not bad, "\n".join(bad)


def test_tooling_is_outside_the_package():
  assert not (ROOT / PACKAGE / "bench").exists() and not (ROOT / PACKAGE / "demo.py").exists()
  for name, path in _modules("benchmarks").items():
    inside = _flat_imports(path, "benchmarks")[0]
    assert "__main__" not in inside, f"benchmarks.{name} imports the command line (a cycle)"


def test_training_never_imports_the_benchmarks():
  """The example trainer stands alone: the benchmarks may import it (``benchmarks._common``
  re-exports ``training.timing``), never the reverse."""
  bad = [f"training.{name} imports benchmarks" for name, path in _modules("training").items()
         if "benchmarks" in _flat_imports(path, "training")[1]]
  assert not bad, "\n".join(bad)


_PROBE = r"""
import json, sys
import jax
before = dict(jax.config.values)
import jax_qcomm
from jax._src import xla_bridge
after = dict(jax.config.values)
print(json.dumps({
    "modules": sorted(sys.modules),
    "config_changed": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
    "backend_initialised": xla_bridge.backends_are_initialized(),
}))
"""


def test_import_jax_qcomm_loads_no_tooling_and_has_no_side_effects():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",) and not k.startswith("QCOMM_")}
  proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  loaded = set(got["modules"])
  forbidden = sorted(m for m in loaded
                     if m.split(".")[0] in NEVER_IN_LIBRARY
                     or m.startswith(f"{PACKAGE}.{TOOLS}"))
  assert not forbidden, f"import jax_qcomm loaded {forbidden}"
  assert got["config_changed"] == [], f"import jax_qcomm changed jax.config: {got['config_changed']}"
  # A backend started at import would freeze jax_num_cpu_devices and the distributed setup.
  assert not got["backend_initialised"], "import jax_qcomm initialised a JAX backend"
