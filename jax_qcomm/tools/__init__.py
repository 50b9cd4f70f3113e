"""Tooling built on the library, never imported by it (``import jax_qcomm`` loads none of this).

* :mod:`jax_qcomm.tools.efficiency` -- the cost model: wire bytes per codec (the codecs' own
  sizes), communication time, scaling efficiency with accumulation (docs/efficiency.md).
* :mod:`jax_qcomm.tools.distributed` -- joins JAX processes with ``jax.distributed`` (gloo on CPU),
  a global mesh, and the one place for the fault timeouts (docs/distributed.md).
* :mod:`jax_qcomm.tools.launch` -- ``python -m jax_qcomm.tools.launch -n N script.py``: starts N
  local processes with the environment :mod:`~jax_qcomm.tools.distributed` reads.
* :mod:`jax_qcomm.tools.cluster` -- ``python -m jax_qcomm.tools.cluster --nodes N --rate 1gbit --
  script.py``: N processes in network namespaces joined by tc-shaped links (root, Linux).

Import the modules themselves (``from jax_qcomm.tools import efficiency``); this file imports
nothing, so that loading one tool does not load the others.
"""
