"""Deprecated alias of :mod:`jax_qcomm._compat` (the vma helpers moved there); removed once the last
importer (sync, _varying) imports _compat."""

from jax_qcomm._compat import cond, make_varying, vma_of  # noqa: F401
