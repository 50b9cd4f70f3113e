"""The package's layering, kept: a module imports only modules of its own or lower layers, the import
graph has no cycles, and ``import jax_qcomm`` loads no tooling and changes nothing in JAX.

The layers (docs/architecture.md), lowest first::

    wire, _checks, _compat, transport  ->  axes, _exchange  ->  _ffi, _reference (the kernels)  ->  _selftest
    ->  codecs
    ->  packing, _varying  ->  shard_layout, clipping  ->  collectives  ->  accumulation, sync
    ->  data_parallel, describe
    ->  flax_nnx (the NNX step; the one module that imports flax, loaded only when
    ``qcomm.nnx_data_parallel`` is asked for)  ->  jax_qcomm (the public API)

``jax_qcomm.tools`` (the cost model ``efficiency``, the multi-process runtime ``distributed`` and
``launch``, the simulated cluster ``cluster``) sits above the library: its modules may import the library and each other, and nothing
in the library imports them. Tooling outside the package (``benchmarks/``, ``training/``,
``configs/``) may import the library and the tools; the library never imports it.

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

#: Lowest first. A module may import modules of its own layer or of a lower one.
LAYERS: list[set[str]] = [
    {"wire", "_checks", "_compat", "transport"},     # foundations: no package imports
    {"axes", "_exchange"},                           # axis arguments; all-to-all schedules
    {"_ffi", "_reference", "_known_answers"},        # the kernels: FFI binding, pure-JAX reference
    {"_selftest"},                                   # the kernels' known-answer test
    {"codecs"},                                      # the Codec interface (the reduction protocol)
    {"packing", "_varying", "specs"},                # pytrees <-> flat buffers, per-device checks,
                                                     # where each part of a qcomm state lives
    {"shard_layout", "clipping", "_parts"},          # per-leaf shards and their rows; global norm;
                                                     # keys, error feedback, finite guard, counters
    {"collectives"},                                 # allreduce, reduce_scatter, all_gather
    {"accumulation", "sync"},                        # micro-batches, the optax wrapper
    {"data_parallel", "describe", "diloco",          # the step helpers, describe, outer sync,
     "elastic", "overlap"},                          # diloco across processes that come and go,
                                                     # its collective on devices of its own
    {"flax_nnx"},                                    # the NNX step (imports flax; loaded lazily)
    {"__init__"},                                    # the public API
]
#: The tooling subpackage (jax_qcomm/tools): above the library, never imported by it.
TOOLS = "tools"
#: Library subpackages: each is one entry of LAYERS, and its modules obey that layer's rule.
LIBRARY_SUBPACKAGES = {"codecs"}
#: Compiled extension modules (built by CMake; the binding layer loads them).
EXTENSIONS = {"_qcomm_cpu", "_qcomm_cuda"}
#: Packages outside jax_qcomm that the library must never import (tooling, optional extras).
NEVER_IN_LIBRARY = {"benchmarks", "training", "configs", "matplotlib", "flax", "tensorflow",
                    "tensorflow_datasets", "orbax", "nbclient", "pytest", "torch"}
#: The one module allowed to reach jax's private modules (jax._src, jaxlib._jax): _compat, for the
#: gloo-on-an-interface registration (its GLOO_PRIVATE_NAMES; tests/test_faults.py checks them).
JAX_PRIVATE_ALLOWED = {"_compat"}
#: Library modules allowed one optional framework each, never loaded by ``import jax_qcomm``.
OPTIONAL_FRAMEWORK = {"flax_nnx": {"flax"}}
_PRIVATE_PREFIXES = ("jax._src", "jaxlib._")


def _package_dir(package: str) -> pathlib.Path:
  return ROOT.joinpath(*package.split("."))


def _modules(package: str) -> dict[str, pathlib.Path]:
  """The modules of a package (dotted: ``jax_qcomm.tools``)."""
  return {p.stem: p for p in sorted(_package_dir(package).glob("*.py"))}


def _imports(path: pathlib.Path, package: str) -> tuple[set[str], set[str]]:
  """(modules of `package` (dotted for a subpackage) that `path` imports, other top-level packages
  it imports)."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  inside, outside = set(), set()
  prefix = package.split(".")

  def add(name: str, names: list[str] = ()) -> None:
    parts = name.split(".")
    if parts[:len(prefix)] != prefix:
      outside.add(parts[0] if parts[0] != "jax" or len(parts) < 2 else ".".join(parts[:2]))
      return
    if len(parts) > len(prefix):
      inside.add(parts[len(prefix)])
    else:  # from jax_qcomm import x, y: submodules or names of __init__
      submodules = {n for n in names
                    if (_package_dir(package) / f"{n}.py").exists() or n in EXTENSIONS}
      inside.update(submodules)
      if len(submodules) < len(names) or not names:  # names defined by __init__ itself
        inside.add("__init__")

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative import: resolve against the package
        add(".".join(filter(None, [package, node.module])), [a.name for a in node.names])
      elif node.module:
        add(node.module, [a.name for a in node.names])
  return inside, outside


def _library_modules() -> dict[str, pathlib.Path]:
  """The library's modules, those of its subpackages dotted (``codecs.base``)."""
  return {**_modules(PACKAGE),
          **{f"{sub}.{k}": v for sub in LIBRARY_SUBPACKAGES
             for k, v in _modules(f"{PACKAGE}.{sub}").items()}}


def _graph(package: str) -> dict[str, set[str]]:
  """module -> the modules of the same package it imports."""
  return {name: _imports(path, package)[0] - {name} for name, path in _modules(package).items()}


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
  placed = set().union(*LAYERS)
  missing = set(_modules(PACKAGE)) - placed
  assert not missing, f"modules with no layer (add them to LAYERS and docs/architecture.md): {missing}"
  subpackages = {p.name for p in (ROOT / PACKAGE).iterdir()
                 if p.is_dir() and (p / "__init__.py").exists()}
  expected = {TOOLS} | LIBRARY_SUBPACKAGES
  assert subpackages == expected, f"subpackages other than {expected}: {subpackages - expected}"


def test_no_module_imports_upward():
  layer = {m: i for i, names in enumerate(LAYERS) for m in names}
  graph = _graph(PACKAGE)
  for sub in LIBRARY_SUBPACKAGES:  # a subpackage's modules: the layer of the subpackage
    for name, path in _modules(f"{PACKAGE}.{sub}").items():
      graph[f"{sub}.{name}"] = _imports(path, PACKAGE)[0] - {sub}
      layer[f"{sub}.{name}"] = layer[sub]
  bad = []
  for module, deps in graph.items():
    deps = deps - EXTENSIONS
    for dep in deps:
      if dep == TOOLS:
        bad.append(f"{module} -> {PACKAGE}.{TOOLS} (the library never imports its tooling)")
      elif dep in layer and module in layer and layer[dep] > layer[module]:
        bad.append(f"{module} (layer {layer[module]}) -> {dep} (layer {layer[dep]})")
  assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_tools_import_only_the_library_and_each_other():
  """The tools are a layer above the public API: they may use any library module (the foundations
  included) and each other (test_no_import_cycles keeps those imports acyclic), nothing else of
  the package."""
  for name, path in _modules(f"{PACKAGE}.{TOOLS}").items():
    inside, _ = _imports(path, PACKAGE)
    assert inside <= set().union(*LAYERS) | {TOOLS} | EXTENSIONS, (name, inside)


@pytest.mark.parametrize("package", [PACKAGE, f"{PACKAGE}.{TOOLS}", "benchmarks"]
                         + [f"{PACKAGE}.{sub}" for sub in sorted(LIBRARY_SUBPACKAGES)])
def test_no_import_cycles(package):
  cycle = _cycle(_graph(package))
  assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_library_imports_no_tooling_and_no_jax_internals():
  bad = []
  modules = {**_library_modules(),
             **{f"{TOOLS}.{k}": v for k, v in _modules(f"{PACKAGE}.{TOOLS}").items()}}
  for name, path in modules.items():
    outside = _imports(path, PACKAGE)[1]
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
    inside = _imports(path, "benchmarks")[0]
    assert "__main__" not in inside, f"benchmarks.{name} imports the command line (a cycle)"


def test_training_never_imports_the_benchmarks():
  """The example trainer stands alone: the benchmarks may import it (``benchmarks._common``
  re-exports ``training.timing``), never the reverse."""
  bad = [f"training.{name} imports benchmarks" for name, path in _modules("training").items()
         if "benchmarks" in _imports(path, "training")[1]]
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
