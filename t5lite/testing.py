"""Helpers for tests: tiny models, fake-device subprocesses, in-memory tasks.

Shipped with the package so users can test their own gin files and tasks the
same way t5lite tests its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import seqio
import tensorflow as tf

from t5lite import optimizers
from t5lite.data import vocabularies
from t5lite.models import models, transformer


# Sizes differ on every axis so a swapped dimension fails loudly.
TINY = dict(vocab_size=384, emb_dim=8, num_heads=4, head_dim=3, mlp_dim=16,
            num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)


def tiny_config(**overrides) -> transformer.TransformerConfig:
  return transformer.TransformerConfig(**{**TINY, **overrides})


def tiny_encoder_decoder(optimizer: optimizers.Learner | None = None,
                         **overrides) -> models.EncoderDecoderModel:
  """A byte-vocabulary encoder-decoder small enough for unit tests."""
  vocab = vocabularies.byte_vocabulary()
  return models.EncoderDecoderModel(
      module=transformer.EncoderDecoder(config=tiny_config(**overrides)),
      input_vocabulary=vocab, output_vocabulary=vocab,
      optimizer=optimizer or optimizers.adafactor(0.01))


def tiny_decoder_only(optimizer: optimizers.Learner | None = None,
                      **overrides) -> models.DecoderOnlyModel:
  vocab = vocabularies.byte_vocabulary()
  return models.DecoderOnlyModel(
      module=transformer.DecoderOnly(config=tiny_config(num_encoder_layers=0, **overrides)),
      input_vocabulary=vocab, output_vocabulary=vocab,
      optimizer=optimizer or optimizers.adafactor(0.01))


def param_axes(model: models.BaseModel, input_shapes: Mapping[str, tuple[int, ...]]) -> Any:
  """The logical PartitionSpecs of `model`'s parameters, traced without memory;
  what `TrainState.create` needs for an optimizer that factors by them."""
  boxed = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), input_shapes))
  return nn.get_partition_spec(boxed)["params"]


def fake_device_flags(num_devices: int) -> str:
  """XLA_FLAGS for a process with `num_devices` fake CPU devices, keeping the
  other XLA flags of this process's environment."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count=")]
  return " ".join([*kept, f"--xla_force_host_platform_device_count={num_devices}"])


def run_with_devices(code: str, num_devices: int = 8, timeout: int = 600,
                     extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
  """Runs Python `code` in a fresh process with `num_devices` fake CPU devices.

  The device count must be fixed before JAX starts, hence the subprocess,
  which collects garbage as t5lite's console scripts do.
  """
  code = "from t5lite import cli\ncli.collect_garbage_less_during_start_up()\n" + code
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=fake_device_flags(num_devices),
             **(extra_env or {}))
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=timeout)


def register_in_memory_task(name: str, examples: Sequence[Mapping[str, str]],
                            splits: Sequence[str] = ("train", "validation")) -> seqio.Task:
  """Registers a text-to-text task over a list of {'inputs', 'targets'} strings."""
  vocab = vocabularies.byte_vocabulary()

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices(
        {k: [e[k] for e in examples] for k in examples[0]})

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=list(splits)),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
      output_features={k: seqio.Feature(vocab, add_eos=True) for k in examples[0]})


def stack_layers(tree: Any) -> Any:
  """A params tree of unscanned `layers_{i}` subtrees rewritten as the one
  stacked `layers` subtree of the same model with `scan_layers=True`.

  Stacked with NumPy: an eager `jnp.stack` compiles a program per leaf shape.
  """
  if not isinstance(tree, dict):
    return tree
  names = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k[7:]))
  out = {k: stack_layers(v) for k, v in tree.items() if k not in names}
  if names:
    out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *[tree[k] for k in names])
  return out
