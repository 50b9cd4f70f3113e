"""Argument checks shared by the public functions (clear ValueErrors naming the parameter)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp


def check_int(name: str, value: Any, minimum: int = 1) -> int:
  """`value` as an int >= minimum (bools rejected), else ValueError naming `name`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if minimum == 0:
      kind = "a non-negative integer"
    raise ValueError(f"{name} must be {kind}, got {value!r}")
  return int(value)


def check_int_or_none(name: str, value: Any, minimum: int = 1) -> int | None:
  """None, or `value` as an int >= minimum; else ValueError naming `name`."""
  if value is None:
    return None
  try:
    return check_int(name, value, minimum)
  except ValueError:
    raise ValueError(f"{name} must be None or an integer >= {minimum}, got {value!r}") from None


def check_int_in(name: str, value: Any, lo: int, hi: int, context: str = "",
                 hi_text: str | None = None) -> int:
  """`value` as an int in lo..hi (bools and floats rejected), else ValueError:
  "<name> must be an integer in lo..<hi_text or hi><context>, got <value>"."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
    raise ValueError(f"{name} must be an integer in {lo}..{hi if hi_text is None else hi_text}"
                     f"{context}, got {value!r}")
  return int(value)


# ---- the checks of every public parameter: trace-time Python checks, no runtime cost --
# One message format throughout: "<name> must be <what is allowed>, got <what was passed>".
# ValueError throughout, for bad values and wrong types alike: the library's convention since its
# first checks (tests assert ValueError for `bits="4"`, `error_feedback="yes"`, `codec=object()`).

FLOAT_DTYPE_NAMES = "float32, bfloat16 or float16"


def shown(value: Any) -> str:
  """What was passed, for a message: dtype and shape for arrays, else a (shortened) repr."""
  if hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, type):
    return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
  text = repr(value)
  return text if len(text) <= 120 else text[:117] + "..."


def check_bool(name: str, value: Any) -> bool:
  """`value` as a bool if it is one (Python or NumPy bool), else ValueError: no truthiness, so
  that `compress_1d="no"` is an error rather than True."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {shown(value)}")
  return bool(value)


def check_choice(name: str, value: Any, allowed: tuple) -> Any:
  """`value` if it is one of `allowed` (strings), else ValueError listing them."""
  if not isinstance(value, str) or value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {shown(value)}")
  return value


def check_real(name: str, value: Any) -> float:
  """`value` as a float if it is a finite real number (Python, NumPy, or a concrete 0-d array;
  bools rejected), else ValueError."""
  ok = not isinstance(value, (bool, np.bool_, str, bytes))
  if ok and hasattr(value, "shape"):
    ok = tuple(value.shape) == () and (np.issubdtype(value.dtype, np.floating)
                                       or np.issubdtype(value.dtype, np.integer))
  if ok:
    try:
      out = float(value)
    except Exception:  # a tracer (not concrete), or an object without __float__
      ok = False
  if not ok or not np.isfinite(out):
    raise ValueError(f"{name} must be a finite real number, got {shown(value)}")
  return out


def check_float_dtype(name: str, dtype: Any) -> np.dtype:
  """`dtype` as a dtype if it is float32, bfloat16 or float16 (the dtypes whose values the codecs
  and collectives carry), else ValueError: an integer dtype would silently truncate."""
  try:
    d = jnp.dtype(dtype)
  except Exception:  # "foo", 5, an object: not a dtype at all
    d = None
  if d is None or d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"{name} must be a floating dtype ({FLOAT_DTYPE_NAMES}), got "
                     f"{d if d is not None else shown(dtype)}")
  return d


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
  """`shape` as a tuple if it is a sequence of non-negative integers, else ValueError."""
  ok = not isinstance(shape, (str, bytes)) and hasattr(shape, "__iter__") and not hasattr(shape, "keys")
  dims: tuple = ()
  if ok:
    try:
      dims = tuple(shape)
    except Exception:
      ok = False
  if ok and not all(not isinstance(d, (bool, np.bool_)) and isinstance(d, (int, np.integer))
                    and d >= 0 for d in dims):
    ok = False
  if not ok:
    raise ValueError(f"{name} must be a tuple of non-negative integers, got {shown(shape)}")
  return tuple(int(d) for d in dims)


def _raw_key_shape() -> tuple[int, ...]:
  """Shape of a raw key (uint32 key data) of the default PRNG implementation: (2,) for threefry."""
  impl = jax.config.jax_default_prng_impl
  if impl not in _RAW_KEY_SHAPES:
    _RAW_KEY_SHAPES[impl] = tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)
  return _RAW_KEY_SHAPES[impl]


_RAW_KEY_SHAPES: dict = {}


def check_key(name: str, key: Any) -> None:
  """ValueError unless `key` is None or one JAX PRNG key, as jax.random accepts it: a typed key
  (``jax.random.key(0)``, shape ``()``) or a raw key (``jax.random.PRNGKey(0)``: uint32 data of
  the default implementation's shape, ``(2,)`` for threefry). Works on tracers (reads only the
  dtype and shape)."""
  if key is None:
    return
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  if dtype is not None and shape is not None:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      if tuple(shape) == ():
        return
      raise ValueError(f"{name} must be a single JAX PRNG key, got a key array of shape "
                       f"{tuple(shape)}")
    if np.dtype(dtype) == np.uint32 and tuple(shape) == _raw_key_shape():
      return
  raise ValueError(f"{name} must be a JAX PRNG key (jax.random.key(...), or the raw uint32"
                   f"{list(_raw_key_shape())} of jax.random.PRNGKey(...)), got {shown(key)}")


def check_axis_name(name: str, value: Any, extra: tuple = (), extra_what: str = "") -> Any:
  """`value` if it is a mesh axis name (a hashable, not None), a non-empty tuple of names, or an
  instance of one of the `extra` types (e.g. ``Hierarchical`` where it is allowed), else
  ValueError."""
  if extra and isinstance(value, extra):
    return value

  def one(v):
    if v is None or isinstance(v, (tuple, list, set, dict)) or isinstance(v, extra):
      return False
    try:
      hash(v)
    except TypeError:
      return False
    return True

  if one(value) or (isinstance(value, tuple) and value and all(one(v) for v in value)):
    return value
  what = "a mesh axis name (e.g. 'data') or a non-empty tuple of names" + (
      f" or {extra_what}" if extra_what else "")
  raise ValueError(f"{name} must be {what}, got {shown(value)}")


def check_instance(name: str, value: Any, types: Any, what: str) -> Any:
  """`value` if isinstance(value, types), else ValueError saying `what` is allowed."""
  if not isinstance(value, types):
    raise ValueError(f"{name} must be {what}, got {shown(value)}")
  return value


def check_callable(name: str, value: Any) -> Any:
  """`value` if it is callable, else ValueError."""
  if not callable(value):
    raise ValueError(f"{name} must be callable, got {shown(value)}")
  return value


def check_array(name: str, value: Any) -> Any:
  """`value` if it is an array (JAX, NumPy, or a tracer: anything with a dtype and a shape), else
  ValueError."""
  if isinstance(value, type) or not (hasattr(value, "dtype") and hasattr(value, "shape")):
    raise ValueError(f"{name} must be an array, got {shown(value)}")
  return value


def as_array(name: str, value: Any) -> Any:
  """``jnp.asarray(value)`` (arrays, NumPy arrays, nested lists of numbers), else ValueError."""
  try:
    return jnp.asarray(value)
  except Exception:
    raise ValueError(f"{name} must be an array, got {shown(value)}") from None


def check_array_leaves(name: str, tree: Any) -> None:
  """ValueError naming the first leaf of `tree` that is neither an array (or a
  ``jax.ShapeDtypeStruct``) nor a Python number."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, (bool, int, float, complex, np.generic)):
      continue
    if isinstance(leaf, (type, str, bytes)) or not hasattr(leaf, "shape"):
      where = jax.tree_util.keystr(path) or "<root>"
      raise ValueError(f"{name} leaf {where} must be an array (or a jax.ShapeDtypeStruct), "
                       f"got {shown(leaf)}")


def path_str(path: Sequence[Any]) -> str:
  """'params/Dense_0/kernel' for a pytree key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)
