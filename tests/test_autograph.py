"""AutoGraph leaves t5lite's and SeqIO's own map functions as written
(`t5lite.data.autograph`): the same batches, and users' code still rewritten."""

import hashlib

import numpy as np
import pytest
import seqio
import tensorflow as tf
from tensorflow.python.autograph.core import config, config_lib

from t5lite.data import autograph, datasets, tasks


# (task, feature lengths, converter) covering every embedded kind of pipeline:
# corpus span corruption, corpus LM, generated problems, a mixture.
_PIPELINES = [
    (tasks.SPAN_CORRUPTION, {"inputs": 32, "targets": 16}, seqio.EncDecFeatureConverter),
    (tasks.SPAN_CORRUPTION_SPM, {"inputs": 32, "targets": 16}, seqio.PrefixLMFeatureConverter),
    (tasks.LM, {"targets": 32}, seqio.DecoderFeatureConverter),
    (tasks.SORT, {"inputs": 16, "targets": 16}, seqio.EncDecFeatureConverter),
]


def _digest(name, lengths, converter, pack):
  cfg = datasets.DatasetConfig(name, lengths, "train", batch_size=4, shuffle=True, seed=3,
                               pack=pack)
  digest = hashlib.sha256()
  for batch in datasets.get_dataset(cfg, 0, 1, converter).take(2).as_numpy_iterator():
    for key in sorted(batch):
      digest.update(key.encode() + np.ascontiguousarray(batch[key]).tobytes())
  return digest.hexdigest()


def _without_t5lite_rules():
  return tuple(rule for rule in config.CONVERSION_RULES
               if getattr(rule, "_prefix", None) not in autograph.PLAIN_MODULES)


def test_rules_are_installed_once_on_import():
  # Fails when a TensorFlow release moves its conversion rules, so that the
  # skip silently stopped working.
  assert autograph.skip_known_code()
  assert autograph.skip_known_code()
  prefixes = [getattr(rule, "_prefix", None) for rule in config.CONVERSION_RULES
              if isinstance(rule, config_lib.DoNotConvert)]
  for module in autograph.PLAIN_MODULES:
    assert prefixes.count(module) == 1, module
  assert "seqio.utils" not in prefixes and "seqio" not in prefixes


@pytest.mark.parametrize("pack", [False, True])
def test_pipelines_give_the_same_batches_with_and_without_rewriting(pack, monkeypatch):
  name_of_mixture = datasets.register_mixture(
      "autograph_test_mixture", {tasks.SPAN_CORRUPTION: 2.0, tasks.ARITHMETIC: 1.0})
  pipelines = [*_PIPELINES, (name_of_mixture, {"inputs": 32, "targets": 16},
                             seqio.EncDecFeatureConverter)]
  skipped = [_digest(*p, pack) for p in pipelines]
  monkeypatch.setattr(config, "CONVERSION_RULES", _without_t5lite_rules())
  rewritten = [_digest(*p, pack) for p in pipelines]
  assert skipped == rewritten


def _user_preprocessor(dataset):
  """Python control flow over a tensor: traceable only through AutoGraph."""
  def clip_long(features):
    targets = features["targets"]
    if tf.size(targets) > 3:
      targets = targets[:3]
    return {**features, "targets": targets}
  return dataset.map(clip_long)


def test_users_preprocessors_are_still_rewritten():
  ds = tf.data.Dataset.from_tensor_slices({"targets": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]})
  clipped = [list(ex["targets"]) for ex in _user_preprocessor(ds).as_numpy_iterator()]
  assert clipped == [[1, 2, 3], [6, 7, 8]]
