"""Names of the leaves of a pytree, spelled one way: 'encoder/layers_0/mlp/wi/kernel'.

The name a person reads in `model-info.txt`, the dry run's table and error
messages, the key checkpoint shape checks, restores and imports match on, and
the path optimizer rules match: dict keys, attribute names and sequence
indices joined with '/'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def key_name(key: Any) -> str:
  """One step of a path: a dict key, an attribute name or a sequence index."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: Sequence[Any]) -> str:
  """A whole path, as from `jax.tree_util.tree_flatten_with_path`."""
  return "/".join(key_name(k) for k in path)


def leaves_by_name(tree: Any) -> dict[str, Any]:
  """{path name: leaf}, in the tree's leaf order."""
  return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
