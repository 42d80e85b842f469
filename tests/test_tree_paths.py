"""The one spelling of a leaf's name (t5lite/tree_paths.py)."""

import flax.struct
import numpy as np

from t5lite import tree_paths


@flax.struct.dataclass
class _State:
  params: dict
  opt_state: tuple


def test_dict_keys_attributes_and_indices_join_with_slashes():
  state = _State(params={"encoder": {"mlp": {"wi": np.zeros(2)}}},
                 opt_state=(np.ones(1), {"v_row": np.zeros(3)}))
  named = tree_paths.leaves_by_name(state)
  assert list(named) == ["params/encoder/mlp/wi", "opt_state/0", "opt_state/1/v_row"]
  assert named["opt_state/1/v_row"].shape == (3,)


def test_path_name_matches_leaves_by_name():
  import jax
  tree = {"a": [np.zeros(1), {"b": np.zeros(1)}]}
  paths = [tree_paths.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert paths == list(tree_paths.leaves_by_name(tree)) == ["a/0", "a/1/b"]
