"""Dataset configuration and per-host seqio pipelines for training and evaluation.

`DatasetConfig` is what gin configures (scoped `train/`, `train_eval/`,
`infer_eval/`); `validate_dataset_config` checks it without building any
tf.data graph; `get_dataset` builds this host's shard, converted to model
features and batched.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
import sys
import threading
from collections.abc import Mapping

import seqio
import tensorflow as tf

# Importing tasks registers the embedded tasks.
from t5lite.data import preprocessors, tasks
from t5lite.errors import UserError


# SeqIO hands its random preprocessors their seeds from one process-wide
# counter while it traces a pipeline (`seqio.utils.map_seed_manager`), so two
# pipelines traced at once on two threads would take each other's seeds.
# t5lite traces pipelines on background threads (the training data, the
# evaluators): each such trace holds this lock.
TRACING = threading.RLock()

# Longest list of registered names an error message prints in full.
_MAX_LISTED_NAMES = 40
_SPAN_CORRUPTION_OPTIONS = ("mean_noise_span_length", "noise_density")


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """What to read and how: a seqio task or mixture, lengths, split, batching.

  Attributes:
    mixture_or_task_name: a registered seqio Task or Mixture.
    task_feature_lengths: length per task feature, e.g.
      {"inputs": 512, "targets": 114}.
    split: e.g. "train" or "validation".
    batch_size: GLOBAL batch size across all hosts.
    shuffle: shuffle examples (use for training).
    seed: makes shuffling and random preprocessing reproducible; None
      draws fresh randomness.
    use_cached: read the offline seqio cache (see `seqio_cache_tasks`).
    pack: pack several examples into each row.
    module: Python module imported before lookup, e.g. one that registers
      the user's own tasks; found on the Python path or in the current
      directory.
    use_memory_cache: let seqio keep small datasets in memory.
    trim_output_features: cut features longer than their length.
    shard_by_host: training only. False (the default): every host builds the
      same global pipeline and keeps its rows of each global batch, so the
      data order is a function of the global example position alone and is
      the same in 1 or N processes, and on a restart on another process
      count. True: each host reads, shuffles and packs its own shard (less
      input work per host in a large job); the order then depends on the
      number of processes.
  """

  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  split: str
  batch_size: int
  shuffle: bool
  seed: int | None
  use_cached: bool = False
  pack: bool = False
  module: str | None = None
  use_memory_cache: bool = True
  trim_output_features: bool = True
  shard_by_host: bool = False


def _import_task_module(module: str) -> None:
  """Imports a module that registers tasks, turning any failure into ValueError.

  The current directory is searched last, as `python -m` would: console
  scripts do not put it on the path, yet that is where a user's task module
  usually sits.
  """
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.append(os.getcwd())
  try:
    importlib.import_module(module)
  except Exception as e:  # A user module can fail in any way while importing.
    raise UserError(
        f"Could not import task module '{module}' (MIXTURE_OR_TASK_MODULE): "
        f"{type(e).__name__}: {e}. Make sure it is importable from the "
        "Python path and registers its tasks when imported."
    ) from e


def _registered_names() -> list[str]:
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


def _unknown_name_message(name: str) -> str:
  """Error text for an unregistered name: a close match, the registered names, the fix."""
  names = _registered_names()
  close = difflib.get_close_matches(name, names, n=1)
  suggestion = f" Did you mean '{close[0]}'?" if close else ""
  listed = ", ".join(names[:_MAX_LISTED_NAMES])
  if len(names) > _MAX_LISTED_NAMES:
    listed += f", ... ({len(names) - _MAX_LISTED_NAMES} more)"
  return (
      f"Unknown mixture or task '{name}'.{suggestion} Registered: {listed}. "
      "Register it in a module and pass --gin.MIXTURE_OR_TASK_MODULE=<module>."
  )


def _prepare_registry(module: str | None) -> None:
  """Registers the embedded tasks if the registry was reset, then imports `module`."""
  if not set(tasks.EMBEDDED_TASKS) <= set(seqio.TaskRegistry.names()):
    tasks.register_tasks()  # Someone reset the registry since import.
  if module:
    _import_task_module(module)


def get_mixture_or_task(name: str, module: str | None = None) -> seqio.Task | seqio.Mixture:
  """Looks up a registered task or mixture, importing what registers it first.

  Args:
    name: the registered name.
    module: optional module to import first (it registers user tasks).

  Returns:
    The `seqio.Task` or `seqio.Mixture`.

  Raises:
    ValueError: if `module` fails to import, or `name` is not registered
      (the message suggests a close match and lists registered names).
  """
  _prepare_registry(module)
  if name in seqio.MixtureRegistry.names():
    return seqio.MixtureRegistry.get(name)
  if name in seqio.TaskRegistry.names():
    return seqio.TaskRegistry.get(name)
  raise UserError(_unknown_name_message(name))


def _check_mixture_rates(name: str, rates: Mapping[str, float]) -> dict[str, float]:
  """Checks a mixture's components and weights; returns {component: float weight}."""
  if not isinstance(name, str) or not name:
    raise UserError(f"Mixture name must be a non-empty string, got {name!r}.")
  if name in seqio.TaskRegistry.names():
    raise UserError(f"Mixture name '{name}' is already a registered task; choose another name.")
  if not isinstance(rates, Mapping) or not rates:
    raise UserError(
        f"Mixture '{name}' needs a non-empty dict of task name -> sampling weight, got "
        f"{rates!r}, e.g. {{'{tasks.SPAN_CORRUPTION}': 3.0, '{tasks.ARITHMETIC}': 1.0}}.")
  for component, weight in rates.items():
    if component == name:
      raise UserError(f"Mixture '{name}' cannot contain itself.")
    if component not in _registered_names():
      raise UserError(f"Mixture '{name}': {_unknown_name_message(component)}")
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
        or not math.isfinite(weight) or weight <= 0):
      raise UserError(f"Mixture '{name}': the weight of '{component}' must be a positive "
                      f"number, got {weight!r}.")
  return {component: float(weight) for component, weight in rates.items()}


def _check_same_features(name: str, components: list[str]) -> None:
  """Every component must produce the same features with the same vocabularies."""
  def signature(component: str) -> dict[str, tuple[str, int]]:
    features = seqio.get_mixture_or_task(component).output_features
    return {key: (type(f.vocabulary).__name__, f.vocabulary.vocab_size)
            for key, f in features.items()}
  first = signature(components[0])
  for component in components[1:]:
    other = signature(component)
    if other != first:
      raise UserError(
          f"Mixture '{name}': '{component}' produces {other} but '{components[0]}' produces "
          f"{first} (feature: (vocabulary, size)); mix only tasks with the same features "
          "and vocabulary.")


def register_mixture(name: str, tasks: Mapping[str, float], module: str | None = None) -> str:
  """Registers a seqio Mixture drawing each example from one task by weight.

  Each example comes whole from one component, chosen with probability
  weight / sum(weights) (seqio mixing rates). Declaring a mixture again
  (gin evaluates the call each time the name is used) re-registers it; the
  last declaration wins. From gin:

    MIXTURE_OR_TASK_NAME = @datasets.register_mixture()
    datasets.register_mixture:
      name = 'span_and_arithmetic'
      tasks = {'t5lite_span_corruption': 3.0, 't5lite_arithmetic': 1.0}
      module = %MIXTURE_OR_TASK_MODULE

  Args:
    name: the mixture's name; must not be a registered task.
    tasks: registered task (or mixture) name -> positive sampling weight.
    module: optional module imported first, registering the user's tasks.

  Returns:
    `name`, so the call can stand wherever a task name is expected.

  Raises:
    ValueError: an unknown component (with a close match and the registered
      names), a weight that is not a positive number, an empty mapping, a
      name taken by a task, or components whose features or vocabularies
      differ.
  """
  _prepare_registry(module)
  rates = _check_mixture_rates(name, tasks)
  _check_same_features(name, list(rates))
  # Always rebuilt, so the mixture holds the tasks registered now (tasks are
  # re-registered when the registry is reset or their module re-imported).
  seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, list(rates.items()))
  return name


def _check_batch_size(batch_size: int, num_shards: int) -> None:
  if not isinstance(num_shards, int) or num_shards < 1:
    raise UserError(f"num_shards must be a positive integer, got {num_shards!r}.")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise UserError(f"batch_size must be a positive integer, got {batch_size!r}.")
  if batch_size % num_shards:
    larger = -(-batch_size // num_shards) * num_shards
    raise UserError(
        f"batch_size {batch_size} is not divisible by the number of data "
        f"shards {num_shards}; use a multiple of {num_shards} such as {larger}."
    )


def _check_split(provider: seqio.Task | seqio.Mixture, split: str) -> None:
  splits = sorted(provider.splits)
  if split not in splits:
    raise UserError(
        f"Split '{split}' is not available for '{provider.name}'. "
        f"Available: {', '.join(splits)}."
    )


def _check_feature_lengths(
    provider: seqio.Task | seqio.Mixture, lengths: Mapping[str, int]
) -> None:
  expected = sorted(provider.output_features)
  if sorted(lengths) != expected:
    raise UserError(
        f"task_feature_lengths keys {sorted(lengths)} do not match the output "
        f"features of '{provider.name}': {expected}. Give one length per feature."
    )
  bad = {key: value for key, value in lengths.items() if not isinstance(value, int) or value < 1}
  if bad:
    raise UserError(f"task_feature_lengths must be positive integers, got {bad}.")


def _check_span_corruption(
    provider: seqio.Task | seqio.Mixture, lengths: Mapping[str, int]
) -> None:
  """Runs span corruption's length checks for every task that uses it."""
  for task in provider.tasks if isinstance(provider, seqio.Mixture) else [provider]:
    for step in task.preprocessors:
      if getattr(step, "func", step) is preprocessors.span_corruption:
        keywords = getattr(step, "keywords", {})
        options = {k: v for k, v in keywords.items() if k in _SPAN_CORRUPTION_OPTIONS}
        preprocessors.span_corruption_chunk_length(lengths, task.output_features, **options)


def validate_dataset_config(cfg: DatasetConfig, num_shards: int = 1) -> None:
  """Checks a config cheaply (no tf.data is built), with one clear error.

  Args:
    cfg: the dataset config.
    num_shards: number of data shards (hosts) the global batch splits over.

  Raises:
    ValueError: if the batch size is not a positive multiple of
      `num_shards`, the task (or its module) is unknown, the split does
      not exist, the feature lengths do not match the task's features, or
      they are too short for the task's span corruption.
  """
  _check_batch_size(cfg.batch_size, num_shards)
  provider = get_mixture_or_task(cfg.mixture_or_task_name, cfg.module)
  _check_split(provider, cfg.split)
  _check_feature_lengths(provider, cfg.task_feature_lengths)
  _check_span_corruption(provider, cfg.task_feature_lengths)


def _as_int32(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """Casts integer and bool features to int32, the dtype the models expect."""
  return {
      key: tf.cast(value, tf.int32) if value.dtype.is_integer or value.dtype.is_bool else value
      for key, value in features.items()
  }


def get_dataset(
    cfg: DatasetConfig,
    shard_id: int,
    num_shards: int,
    feature_converter_cls: type[seqio.FeatureConverter],
    num_epochs: int | None = None,
) -> tf.data.Dataset:
  """Builds this host's batches: its shard, model features, per-host batch size.

  Args:
    cfg: the dataset config; `cfg.batch_size` is global.
    shard_id: this host's data shard, in [0, num_shards).
    num_shards: number of data shards (hosts).
    feature_converter_cls: seqio converter for the model, e.g.
      `seqio.EncDecFeatureConverter`; built with `pack=cfg.pack`.
    num_epochs: passes over the data; None repeats forever.

  Returns:
    A dataset of dicts of int32 arrays shaped
    [cfg.batch_size // num_shards, length]; incomplete batches are
    dropped. Identical on every run for a fixed `cfg.seed`.

  Raises:
    ValueError: for an invalid config (see `validate_dataset_config`) or a
      shard id outside [0, num_shards).
  """
  validate_dataset_config(cfg, num_shards)
  if not isinstance(shard_id, int) or not 0 <= shard_id < num_shards:
    raise UserError(f"shard_id must be in [0, {num_shards}), got {shard_id!r}.")
  provider = get_mixture_or_task(cfg.mixture_or_task_name, cfg.module)
  with TRACING:
    ds = provider.get_dataset(
        sequence_length=dict(cfg.task_feature_lengths),
        split=cfg.split,
        use_cached=cfg.use_cached,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        shard_info=seqio.ShardInfo(index=shard_id, num_shards=num_shards),
        num_epochs=num_epochs,
        trim_output_features=cfg.trim_output_features,
        try_in_mem_cache=cfg.use_memory_cache,
    )
    ds = feature_converter_cls(pack=cfg.pack)(ds, dict(cfg.task_feature_lengths))
    ds = ds.map(_as_int32, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(cfg.batch_size // num_shards, drop_remainder=True).prefetch(
        tf.data.AUTOTUNE)


def get_vocabulary(cfg: DatasetConfig) -> tuple[seqio.Vocabulary, seqio.Vocabulary]:
  """Returns the (inputs, targets) vocabularies of the configured task.

  Args:
    cfg: the dataset config.

  Returns:
    The vocabularies of the "inputs" and "targets" features; a task
    without "inputs" (decoder-only LM) returns its targets vocabulary twice.

  Raises:
    ValueError: if the task is unknown or has no "targets" feature.
  """
  provider = get_mixture_or_task(cfg.mixture_or_task_name, cfg.module)
  features = provider.output_features
  if "targets" not in features:
    raise UserError(
        f"'{cfg.mixture_or_task_name}' has no 'targets' feature (features: "
        f"{', '.join(sorted(features))}); t5lite models need one."
    )
  targets = features["targets"].vocabulary
  inputs = features["inputs"].vocabulary if "inputs" in features else targets
  return inputs, targets
