"""Weighted seqio mixtures registered from gin: sampling rates and errors."""

import math

import numpy as np
import pytest
import seqio

import gin
from t5lite import cli, testing
from t5lite.data import datasets


LENGTHS = {"inputs": 8, "targets": 8}


@pytest.fixture(scope="module")
def two_tasks():
  # Inputs start with 'a' or 'b', so every example names its source.
  testing.register_in_memory_task("mix_test_a", [{"inputs": f"a{i}", "targets": "x"}
                                                 for i in range(7)])
  testing.register_in_memory_task("mix_test_b", [{"inputs": f"b{i}", "targets": "y"}
                                                 for i in range(5)])
  return "mix_test_a", "mix_test_b"


def _count_sources(name, n, seed):
  ds = seqio.get_mixture_or_task(name).get_dataset(
      sequence_length=LENGTHS, split="train", shuffle=True, seed=seed, num_epochs=None,
      use_cached=False)
  first = [int(ex["inputs"][0]) for ex in ds.take(n).as_numpy_iterator()]
  byte_a = seqio.ByteVocabulary().encode("a")[0]
  byte_b = seqio.ByteVocabulary().encode("b")[0]
  assert set(first) <= {byte_a, byte_b}  # each example comes whole from one task
  return first.count(byte_a), first.count(byte_b)


def test_sampling_follows_the_weights(two_tasks):
  name = datasets.register_mixture("mix_test_ab", {"mix_test_a": 3.0, "mix_test_b": 1.0})
  assert name == "mix_test_ab"
  mixture = seqio.get_mixture_or_task(name)
  assert isinstance(mixture, seqio.Mixture)
  assert sorted(t.name for t in mixture.tasks) == ["mix_test_a", "mix_test_b"]
  n = 2000
  count_a, count_b = _count_sources(name, n, seed=3)
  assert count_a + count_b == n
  # count_a ~ Binomial(2000, 3/4): mean 1500, sd sqrt(2000 * 3/4 * 1/4) = 19.4.
  # Five sd (97 examples) would fail a correct sampler about once in 1.7 million.
  sd = math.sqrt(n * 0.75 * 0.25)
  assert abs(count_a - 0.75 * n) < 5 * sd, (count_a, count_b)
  # A 1:1 mixture (1500 would be 25 sd away) is not what was sampled.
  assert abs(count_a - 0.5 * n) > 20 * sd


def test_same_declaration_again_is_idempotent_and_new_weights_replace(two_tasks):
  rates = {"mix_test_a": 1.0, "mix_test_b": 4.0}
  datasets.register_mixture("mix_test_again", rates)
  datasets.register_mixture("mix_test_again", rates)  # as gin does for each use
  mixture = seqio.get_mixture_or_task("mix_test_again")
  assert dict(mixture.rate_per_task_name) == rates
  datasets.register_mixture("mix_test_again", {"mix_test_a": 2.0, "mix_test_b": 1.0})
  rates_now = seqio.get_mixture_or_task("mix_test_again").rate_per_task_name
  assert dict(rates_now) == {"mix_test_a": 2.0, "mix_test_b": 1.0}


def test_unknown_task_names_a_close_match_and_the_registered_tasks(two_tasks):
  with pytest.raises(ValueError, match=r"Mixture 'm': Unknown mixture or task "
                                       r"'t5lite_arithmetc'\. Did you mean 't5lite_arithmetic'\? "
                                       r"Registered: .*mix_test_a, .*t5lite_span_corruption"):
    datasets.register_mixture("m", {"mix_test_a": 1.0, "t5lite_arithmetc": 1.0})
  assert "m" not in seqio.MixtureRegistry.names()


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), "3", True])
def test_weights_must_be_positive_numbers(two_tasks, weight):
  with pytest.raises(ValueError, match=r"Mixture 'm': the weight of 'mix_test_b' must be a "
                                       r"positive number, got"):
    datasets.register_mixture("m", {"mix_test_a": 1.0, "mix_test_b": weight})


def test_other_declaration_errors(two_tasks):
  with pytest.raises(ValueError, match=r"needs a non-empty dict of task name -> sampling weight"):
    datasets.register_mixture("m", {})
  with pytest.raises(ValueError, match=r"'mix_test_a' is already a registered task"):
    datasets.register_mixture("mix_test_a", {"mix_test_b": 1.0})
  # Decoder-only LM data has no inputs: it cannot share a mixture with span corruption.
  with pytest.raises(ValueError, match=r"Mixture 'm': 't5lite_lm' produces .* but "
                                       r"'t5lite_span_corruption' produces .*same features"):
    datasets.register_mixture("m", {"t5lite_span_corruption": 1.0, "t5lite_lm": 1.0})
  with pytest.raises(ValueError, match=r"vocabulary"):
    datasets.register_mixture("m", {"t5lite_arithmetic": 1.0, "t5lite_arithmetic_spm": 1.0})


def test_shipped_mixture_gin_registers_a_valid_training_mixture(clean_gin):
  cli.parse_gin(["gin/pretrain_dense.gin", "gin/mixtures/span_corruption_and_arithmetic.gin"],
                ["MODEL_DIR = '/tmp/unused'"], cli.gin_search_paths([]))
  name = gin.query_parameter("%MIXTURE_OR_TASK_NAME").scoped_configurable_fn()
  assert name == "t5lite_span_corruption_and_arithmetic"
  mixture = seqio.get_mixture_or_task(name)
  assert dict(mixture.rate_per_task_name) == {"t5lite_span_corruption": 3.0,
                                              "t5lite_arithmetic": 1.0}
  # The headline's lengths, batch and splits suit every task of the mixture.
  for split in ("train", "validation"):
    datasets.validate_dataset_config(datasets.DatasetConfig(
        name, {"inputs": 128, "targets": 32}, split, batch_size=32, shuffle=True, seed=0))
  np.testing.assert_equal(sorted(mixture.output_features), ["inputs", "targets"])
