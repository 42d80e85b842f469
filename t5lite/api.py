"""The Python API: a model and its checkpoint in one call, then logits,
scores, generations and a few training steps.

  from t5lite import api
  model = api.load("gin/models/t5_tiny.gin", "runs/tiny/checkpoints")
  model.generate(["A sentence to continue"])
  model.score(["an input"], ["its target"])

`load` builds the model the way the console scripts do (gin files and
bindings, or the gin file `t5lite-import` would write for a T5X checkpoint
or a Hugging Face folder), places it on the devices present with the
configured partitioner, and reads the parameters of a t5lite, T5X or
Hugging Face checkpoint straight into their shardings. The methods batch
their examples (padding the last batch) and run the same model functions
t5lite-infer and t5lite-eval run.

Like `cli`, this module is an edge: it parses gin, and it borrows `cli`'s
parsing (search paths, one-line messages for unknown names) instead of a
second copy; `cli` is imported only inside the function that parses.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import jax
import numpy as np
import tensorflow as tf

from t5lite import checkpoints as ckpt_lib
from t5lite import decoding, evaluate, inference, interop, state_init, trainer
from t5lite.errors import UserError
from t5lite.models.models import BaseModel
from t5lite.partitioning import Partitioner


# A text (encoded, then EOS appended) or token ids (used as given).
TextOrIds = Union[str, Sequence[int]]
METHODS = ("greedy", "sample", "beam")
# Feature lengths are rounded up to a multiple of this, so that examples of
# nearby lengths share one compiled program.
_LENGTH_MULTIPLE = 8
# Shapes the parameters are traced with; any length gives the same tree.
_SPEC_LENGTHS = {"inputs": 8, "targets": 8}
_DEFAULT_DECODE_LENGTH = 64


@dataclasses.dataclass(frozen=True)
class Generation:
  """One decode of one input.

  Attributes:
    text: the decoded tokens as text (up to EOS).
    tokens: the decoded token ids, EOS included when produced.
    score: summed log-probability of `tokens` (length-normalised for beam
      search, as T5X scores beams).
  """

  text: str
  tokens: tuple[int, ...]
  score: float


def load(source: str | Sequence[str], checkpoint: str | None = None, *,
         gin_bindings: Sequence[str] = (), gin_search_paths: Sequence[str] = (),
         partitioner: Partitioner | None = None, batch_size: int = 8, seed: int = 0) -> Model:
  """Builds a model from gin (or a foreign checkpoint) and reads its parameters.

  Gin holds one config per process: loading clears it before parsing and
  after building the model, so a config parsed earlier is gone (models
  loaded earlier keep theirs).

  Args:
    source: a gin file that defines MODEL (a file of gin/models/, a training
      headline, or one `t5lite-import` wrote), or a list of gin files
      parsed in order (later ones win), a t5lite model_dir (its
      config.gin), or a T5X checkpoint or Hugging Face folder (its model is
      read from the checkpoint, as `t5lite-import` reads it).
    checkpoint: the parameters: a t5lite step directory, model_dir or
      checkpoints directory (its newest step), a T5X checkpoint or a Hugging
      Face folder. Defaults to `source` when that is a model_dir or a foreign
      checkpoint; otherwise None initialises the parameters from `seed`.
    gin_bindings: bindings applied after the file, e.g. "DROPOUT_RATE = 0.1".
    gin_search_paths: extra directories gin files are resolved from (the
      current directory and t5lite's gin/ tree always are).
    partitioner: mesh and rules; default: the gin-configured
      `partitioning.Partitioner` over all devices.
    batch_size: examples per compiled batch (a multiple of the data-parallel
      size); the last batch is padded.
    seed: initialises fresh parameters and seeds dropout in `train`.

  Returns:
    The loaded `Model`.

  Raises:
    UserError: a source or checkpoint that does not exist or does not fit
      the model, invalid gin, or a batch size the mesh cannot split.
  """
  _hide_gpus_from_tensorflow()
  files, default_checkpoint, text = _config_of(source)
  checkpoint = default_checkpoint if checkpoint is None else checkpoint
  model, configured = _from_gin(files, text, gin_bindings, gin_search_paths)
  partitioner = partitioner or configured
  partitioner.validate()
  partitioner.get_data_layout(batch_size)
  specs, init = state_init.state_specs(
      model, partitioner, *model.input_shapes_and_types(_SPEC_LENGTHS, pack=False))
  if checkpoint is None:
    fresh = partitioner.partition(lambda key: init(key).params, in_shardings=None,
                                  out_shardings=specs.shardings.params)
    params, step = fresh(jax.random.key(seed)), 0
  else:
    opened = ckpt_lib.open_checkpoint(checkpoint, "auto")
    _, restore = evaluate.params_restorer(model, partitioner, _SPEC_LENGTHS, opened)
    params, step = restore(opened.step), opened.step
  return Model(model, partitioner, params, specs=specs, step=step, batch_size=batch_size,
               seed=seed)


def _config_of(source: str | Sequence[str]) -> tuple[list[str], str | None, str | None]:
  """(gin files, the checkpoint `source` implies, generated gin text)."""
  if not isinstance(source, str):
    return list(source), None, None
  if source.endswith(".gin"):
    return [source], None, None  # resolved through the search paths
  if not os.path.exists(source):
    raise UserError(f"'{source}' does not exist; give a gin file that defines MODEL, a t5lite "
                    "model_dir, a T5X checkpoint or a Hugging Face folder.")
  if interop.checkpoint_format(source):
    from t5lite.interop import gin_file
    found = interop.describe(source)
    return [], source, gin_file.model_gin(found.network, found.fields, found.vocabulary, source)
  config = os.path.join(source, "config.gin")
  if os.path.isfile(config):
    return [config], source, None
  raise UserError(f"'{source}' is neither a gin file, a t5lite model_dir (with config.gin), "
                  "a T5X checkpoint nor a Hugging Face folder (config.json + *.safetensors).")


def _from_gin(files: list[str], text: str | None, bindings: Sequence[str],
              search_paths: Sequence[str]) -> tuple[BaseModel, Partitioner]:
  """The MODEL and the partitioner that the gin config defines."""
  import gin
  from t5lite import cli, partitioning
  gin.clear_config()
  try:
    with _written(text) as generated:
      cli.parse_gin(files + generated, list(bindings), cli.gin_search_paths(search_paths))
    try:
      reference = gin.query_parameter("%MODEL")
    except ValueError:
      raise UserError(f"{files[0] if files else 'The config'} does not define MODEL; give a "
                      "model file such as gin/models/t5_tiny.gin or a training "
                      "headline.") from None
    # Gin evaluates a macro in a scope of its name: a run's config.gin binds
    # the model's parameters as MODEL/models.EncoderDecoderModel.z_loss = ...
    with gin.config_scope("MODEL"):
      model = copy.deepcopy(reference)  # calls the configurable it references
    if not isinstance(model, BaseModel):
      raise UserError(f"MODEL must be a t5lite model (@models.EncoderDecoderModel() or "
                      f"@models.DecoderOnlyModel()), got {model!r}.")
    try:
      partitioner = gin.get_configurable(partitioning.Partitioner)()
    except ValueError:  # the config never names it: the defaults
      partitioner = partitioning.Partitioner()
    return model, partitioner
  finally:
    gin.clear_config()


@contextlib.contextmanager
def _written(text: str | None) -> Iterator[list[str]]:
  """A temporary gin file holding `text` (none for None)."""
  if text is None:
    yield []
    return
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "imported_model.gin")
    with open(path, "w") as f:
      f.write(text)
    yield [path]


def _hide_gpus_from_tensorflow() -> None:
  # TensorFlow only feeds data; left alone it would take GPU memory JAX needs.
  # Too late when the notebook already used TensorFlow on a GPU: then so be it.
  with contextlib.suppress(RuntimeError):
    tf.config.set_visible_devices([], "GPU")


def _round_up(n: int) -> int:
  return max(_LENGTH_MULTIPLE, -(-n // _LENGTH_MULTIPLE) * _LENGTH_MULTIPLE)


class Model:
  """A model with its parameters on the devices, for interactive use.

  Built by `load`. Inputs and targets are texts (encoded with the model's
  vocabulary, EOS appended) or lists of token ids (used as given, so
  include EOS where the model expects one).

  Attributes:
    model: the t5lite model (`models.BaseModel`).
    partitioner: its mesh and rules.
    params: the parameters, sharded over the mesh (updated by `train`).
    step: the checkpoint's step (0 for fresh parameters), plus the steps
      `train` ran.
    batch_size: examples per compiled batch.
  """

  def __init__(self, model: BaseModel, partitioner: Partitioner, params: Any, *,
               specs: state_init.StateSpecs, step: int, batch_size: int, seed: int):
    self.model = model
    self.partitioner = partitioner
    self.params = params
    self.step = step
    self.batch_size = batch_size
    self._specs = specs
    self._seed = seed
    self._runner = inference.BatchRunner(partitioner, batch_size, specs.shardings.params)
    self._state: Any = None
    self._train_step: Callable | None = None

  @property
  def vocabulary(self) -> Any:
    """The output vocabulary (seqio), which decodes generations."""
    return self.model.output_vocabulary

  def _tokens(self, value: TextOrIds, what: str, vocabulary: Any) -> list[int]:
    """A text's ids with EOS, or ids as given once checked.

    Raises:
      UserError: neither a text nor a list of ids, or an id that is padding
        (0) or past the vocabulary.
    """
    if isinstance(value, str):
      return [*vocabulary.encode(value), vocabulary.eos_id]
    if isinstance(value, np.ndarray) and value.ndim == 1:
      value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value):
      raise UserError(f"Each of {what} must be a string or a list of token ids, got "
                      f"{value!r}.")
    tokens = [int(t) for t in value]
    bad = [t for t in tokens if not 0 < t < vocabulary.vocab_size]
    if bad:
      raise UserError(f"Token ids {bad} in {what} are not in the vocabulary's 1 .. "
                      f"{vocabulary.vocab_size - 1} (0 is padding: leave it out).")
    return tokens

  def _pairs(self, inputs: Sequence[TextOrIds], targets: Sequence[TextOrIds] | None
             ) -> list[tuple[list[int], list[int]]]:
    """Token lists of each (input, target); the target is EOS alone when None."""
    if isinstance(inputs, (str, bytes)):
      raise UserError("inputs must be a list of examples (strings or lists of token ids), "
                      f"got one string {inputs!r}; wrap it in a list.")
    if targets is not None and (isinstance(targets, (str, bytes))
                                or len(targets) != len(inputs)):
      raise UserError(f"targets must be a list as long as inputs ({len(inputs)}), got "
                      f"{targets!r}.")
    eos = [self.model.output_vocabulary.eos_id]
    return [(self._tokens(x, "inputs", self.model.input_vocabulary),
             eos if targets is None else
             self._tokens(targets[i], "targets", self.model.output_vocabulary))
            for i, x in enumerate(inputs)]

  def _features(self, pairs: list[tuple[list[int], list[int]]], targets_length: int | None,
                converter_cls: Any) -> tuple[tf.data.Dataset, dict[str, int]]:
    """The model's features of each pair (enumerated, unbatched) and their lengths."""
    lengths = {"inputs": _round_up(max(len(x) for x, _ in pairs)),
               "targets": targets_length or _round_up(max(len(y) for _, y in pairs))}
    ds = tf.data.Dataset.from_generator(
        lambda: ({"inputs": np.asarray(x, np.int32), "targets": np.asarray(y, np.int32)}
                 for x, y in pairs),
        output_signature={"inputs": tf.TensorSpec([None], tf.int32),
                          "targets": tf.TensorSpec([None], tf.int32)})
    return converter_cls(pack=False)(ds, lengths), lengths

  def _run(self, name: str, fn: Callable, pairs: list[tuple[list[int], list[int]]],
           targets_length: int | None = None, seed: int | None = None) -> list[Any]:
    """`fn(params, batch)` on every pair's inference features, one row each, in order.

    With `seed`, the batch also holds `decode_seed` int32 `[batch]`: the seed
    plus the example's index (a batch's first one seeds its decodes), so a
    new seed needs no new compilation.
    """
    if not pairs:
      return []
    features, _ = self._features(pairs, targets_length,
                                 self.model.INFERENCE_FEATURE_CONVERTER_CLS)
    features = features.enumerate()
    if seed is not None:
      features = features.map(lambda i, ex: (i, {**ex, "decode_seed": tf.cast(i + seed,
                                                                              tf.int32)}))
    return [row for _, row in self._runner.run(name, fn, self.params, features)]

  def logits(self, inputs: Sequence[TextOrIds], targets: Sequence[TextOrIds]
             ) -> list[np.ndarray]:
    """Teacher-forced logits of each target, without dropout.

    Args:
      inputs: the examples' inputs (for a decoder-only model, the prompts).
      targets: their targets, one per input.

    Returns:
      One float32 array `[len(target), vocab]` per example: row i holds the
      logits that predict the target's token i.

    Raises:
      UserError: inputs or targets that are not strings or token ids, or of
        different counts.
    """
    def fn(params, batch):
      return self.model.predict_logits(params, batch), batch["decoder_loss_weights"]
    rows = self._run("logits", fn, self._pairs(inputs, targets))
    return [np.asarray(logits[weights > 0], np.float32) for logits, weights in rows]

  def score(self, inputs: Sequence[TextOrIds], targets: Sequence[TextOrIds]) -> np.ndarray:
    """Log-likelihood of each target given its input (`score_batch`).

    Returns:
      float32 `[len(inputs)]`: the sum over the target's tokens of log
      p(token), as t5lite-eval's score functions see it.

    Raises:
      UserError: as `logits`.
    """
    rows = self._run("score", self.model.score_batch, self._pairs(inputs, targets))
    return np.asarray(rows, np.float32).reshape(-1)

  def generate(self, inputs: Sequence[TextOrIds], *, method: str = "greedy",
               max_length: int | None = None, num_decodes: int | None = None, seed: int = 0,
               temperature: float = 1.0, topk: int = 0, topp: float = 0.0, num_beams: int = 4,
               alpha: float = 0.6) -> list[Generation] | list[list[Generation]]:
    """Decodes each input with greedy search, sampling or beam search.

    Args:
      inputs: texts or token ids (for a decoder-only model, the prompts).
      method: 'greedy', 'sample' (`decoding.temperature_sample`) or 'beam'
        (`decoding.beam_search`).
      max_length: most tokens decoded per input; default: the model's
        max_decode_length, else 64.
      num_decodes: None returns the best decode of each input; a number
        returns that many per input, best first (samples, or the best beams).
      seed: sampling seed; the same seed gives the same samples.
      temperature, topk, topp: sampling's (`decoding.temperature_sample`).
      num_beams, alpha: beam search's width and length normalisation.

    Returns:
      A `Generation` per input, or with `num_decodes` a list of them per input.

    Raises:
      UserError: an unknown method, invalid decoding options, or inputs that
        are not strings or token ids.
    """
    decode_fn, options = _decoder(method, num_decodes, temperature=temperature, topk=topk,
                                  topp=topp, num_beams=num_beams, alpha=alpha)
    length = max_length or self.model.max_decode_length or _DEFAULT_DECODE_LENGTH
    model = copy.copy(self.model)
    model.decode_fn, model.max_decode_length = decode_fn, length

    def fn(params, batch):
      batch = dict(batch)
      rng = jax.random.key(batch.pop("decode_seed")[0])
      tokens, aux = model.predict_batch_with_aux(params, batch, rng, return_all_decodes=True,
                                                 num_decodes=num_decodes or 1)
      return tokens, aux["scores"]
    name = f"generate/{method}/{length}/{num_decodes}/{options}"
    rows = self._run(name, fn, self._pairs(inputs, None), length, seed)
    out = [[self._generation(t, s) for t, s in zip(tokens[::-1], scores[::-1])]
           for tokens, scores in rows]
    return out if num_decodes else [decodes[0] for decodes in out]

  def _generation(self, tokens: np.ndarray, score: float) -> Generation:
    ids = inference.token_list(tokens)
    return Generation(self.vocabulary.decode(ids), tuple(ids), float(score))

  def train(self, inputs: Sequence[TextOrIds], targets: Sequence[TextOrIds], *,
            steps: int = 1) -> list[float]:
    """Optimizer steps on the given examples, with the model's optimizer.

    Every step trains on one batch of `batch_size` examples, taken in turn
    from the examples given (repeated as needed). The optimizer state starts
    fresh at the first call (as a fine-tune of the loaded parameters) and
    carries over to the next; dropout follows the model's config, seeded by
    `load`'s seed. `params` then holds the trained parameters.

    Args:
      inputs: the examples' inputs.
      targets: their targets.
      steps: optimizer steps.

    Returns:
      The loss of each step (before its update).

    Raises:
      UserError: no examples, steps < 1, or inputs that are not strings or
        token ids.
    """
    if steps < 1:
      raise UserError(f"steps must be >= 1, got {steps}.")
    pairs = self._pairs(inputs, targets)
    if not pairs:
      raise UserError("train needs at least one example.")
    features, _ = self._features(pairs, None, self.model.FEATURE_CONVERTER_CLS)
    examples = next(features.batch(len(pairs)).as_numpy_iterator())
    if self._state is None:
      self._state = state_init.state_from_params(self._specs, self.partitioner, self.params)
    shardings = self.partitioner.batch_shardings({k: v.shape for k, v in examples.items()})
    if self._train_step is None:
      train = trainer.Trainer(model=self.model, partitioner=self.partitioner,
                              dropout_seed=self._seed)
      train.validate(self.batch_size)
      self._train_step = train.compile_train_step(self._specs.shardings, shardings)
    losses = []
    for step in range(steps):
      rows = [(step * self.batch_size + i) % len(pairs) for i in range(self.batch_size)]
      batch = self._runner.to_global({k: v[rows] for k, v in examples.items()}, shardings)
      self._state, metrics = self._train_step(self._state, batch)
      losses.append(float(metrics["loss"]))
    self.params = self._state.params
    self.step += steps
    return losses


def _decoder(method: str, num_decodes: int | None, **options: Any
             ) -> tuple[Callable[..., Any], dict[str, Any]]:
  """The decoder of `method` with its options, and those options (for the cache key).

  Raises:
    UserError: an unknown method, or several decodes of greedy search.
  """
  if method not in METHODS:
    raise UserError(f"Unknown generation method {method!r}; use one of {list(METHODS)}.")
  if num_decodes is not None and num_decodes < 1:
    raise UserError(f"num_decodes must be >= 1 or None (the best decode), got {num_decodes}.")
  if method == "greedy":
    if num_decodes not in (None, 1):
      raise UserError(f"Greedy search gives one decode per input, got num_decodes="
                      f"{num_decodes}; use method='sample' or method='beam' for several.")
    return decoding.greedy, {}
  if method == "sample":
    chosen = {k: options[k] for k in ("temperature", "topk", "topp")}
    return functools.partial(decoding.temperature_sample, **chosen), chosen
  chosen = {k: options[k] for k in ("num_beams", "alpha")}
  return functools.partial(decoding.beam_search, **chosen), chosen
