"""The training recipe of a T5X run, read from its operative config for t5lite.

T5X writes the operative config of a run, `config.gin`, into its model_dir:
every binding the run used, with its value. `parse` reads that file (macros
`NAME = value`, bindings `[scope/]module.Class.param = value`, backslash and
open-bracket continuations, comments), resolves `%MACRO` references and reads
literals with `ast.literal_eval`; t5x itself is never imported. `recipe` then
sorts every binding into exactly one of these kinds:

- carried: written under t5lite's names (`gin_file.Recipe`): T5X's
  Adafactor as `optimizers.adafactor`, `utils.create_learning_rate_scheduler`
  as `optimizers.create_learning_rate_scheduler`, the model's loss settings,
  dropout, activation dtype and attention-logit precision, the datasets
  (task, lengths, batch, split, shuffle, seed, packing), the train loop's
  periods and seed, checkpoint saving, microbatches and model partitions.
  Where T5X's Python default differs from t5lite's and the config leaves it
  unbound (Adafactor's logical_factor_rules, z_loss, loss_normalizing_factor,
  dropout, dtype, attention logits, dataset packing), T5X's default is
  written, because that is what the run used.
- model section: network sizes, activations and the vocabulary, which the
  model section of the file already has from the checkpoint and this config.
- wiring: references that only connect T5X's objects (`train.model =
  %MODEL`, `CheckpointConfig.save = @...`, `trainer_cls = @trainer.Trainer`,
  `summarize_config_fn`, ...); t5lite's run file connects its own.
- the user's: the model_dir and the run length (total_steps, relative_steps).
- superseded: `RestoreCheckpointConfig`, which says how the T5X run started;
  the file starts from the imported checkpoint instead.
- t5lite's behaviour already: values that ask for what t5lite always does
  (`use_hardware_rng = False`, `model_parallel_submesh = None`, T5X's
  standard logical axis rules, `use_custom_packing_ops = False`).
- not carried: everything else (another optimizer or schedule, `factor_map`,
  hardware RNG, submesh layouts, decoding settings, ...): each is listed in
  the file with the reason, and `t5lite-import` names them.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

from t5lite.errors import UserError
from t5lite.interop import gin_file, t5x


@dataclasses.dataclass(frozen=True)
class Reference:
  """`@name()` (called) or `@name` in a T5X value."""

  name: str
  called: bool

  @property
  def text(self) -> str:
    return f"@{self.name}{'()' if self.called else ''}"

  def __str__(self) -> str:
    return self.text


@dataclasses.dataclass(frozen=True)
class Constant:
  """`%name` that names no macro of the file: a gin constant such as
  `%losses.SpecialLossNormalizingFactor.NUM_REAL_TARGET_TOKENS`."""

  name: str

  @property
  def text(self) -> str:
    return f"%{self.name}"

  def __str__(self) -> str:
    return self.text


@dataclasses.dataclass(frozen=True)
class _Macro:
  name: str


@dataclasses.dataclass(frozen=True)
class Binding:
  """One `[scope/]configurable.param = value` of a T5X config, macros resolved."""

  scope: str
  configurable: str  # as written, e.g. 'utils.DatasetConfig'
  param: str
  value: Any  # literals, `Reference`s and `Constant`s

  @property
  def key(self) -> str:
    name = f"{self.configurable}.{self.param}"
    return f"{self.scope}/{name}" if self.scope else name

  @property
  def kind(self) -> str:
    """The configurable's own name, whatever module alias the file uses."""
    return self.configurable.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class OperativeConfig:
  """A parsed T5X config.gin: its file, resolved macros and bindings in order."""

  path: str
  macros: dict[str, Any]
  bindings: tuple[Binding, ...]


# ---------------------------------------------------------------------------
# Parsing

_STRING = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")
_REFERENCE = re.compile(r"([@%])([A-Za-z_][\w.]*(?:/[A-Za-z_][\w.]*)*)(\(\))?")
_KEY = re.compile(r"((?:\w+/)*)([A-Za-z_][\w.]*)")
_PLACEHOLDER = "\x00reference"


def _code_and_depth(line: str) -> tuple[str, int]:
  """`line` without its comment, and how many brackets it leaves open."""
  out, depth, i = [], 0, 0
  while i < len(line):
    char = line[i]
    if char in "'\"":
      match = _STRING.match(line, i)
      end = match.end() if match else len(line)
      out.append(line[i:end])
      i = end
      continue
    if char == "#":
      break
    depth += (char in "([{") - (char in ")]}")
    out.append(char)
    i += 1
  return "".join(out).rstrip(), depth


def _statements(text: str, path: str) -> list[tuple[int, str]]:
  """(first line number, statement) with continuations joined, comments dropped."""
  statements, parts, depth, start = [], [], 0, 0
  for number, line in enumerate(text.splitlines(), 1):
    code, opened = _code_and_depth(line)
    if not parts:
      if not code:
        continue
      start = number
    continued = code.endswith("\\")
    parts.append((code[:-1] if continued else code).strip())
    depth += opened
    if not continued and depth <= 0:
      statements.append((start, " ".join(p for p in parts if p)))
      parts, depth = [], 0
  if parts:
    raise UserError(f"{path} line {start}: the value never ends (an unclosed bracket or a "
                    "trailing backslash); fix config.gin or move it away to import the model "
                    "alone.")
  return statements


def _replace(value: Any, found: list[Any]) -> Any:
  if isinstance(value, str) and value.startswith(_PLACEHOLDER):
    return found[int(value[len(_PLACEHOLDER):])]
  if isinstance(value, (tuple, list)):
    return type(value)(_replace(v, found) for v in value)
  if isinstance(value, dict):
    return {_replace(k, found): _replace(v, found) for k, v in value.items()}
  return value


def _value(text: str, where: str) -> Any:
  """A gin value: Python literals with `@ref()`, `@ref` and `%NAME` inside."""
  out, found, i = [], [], 0
  while i < len(text):
    char = text[i]
    if char in "'\"":
      match = _STRING.match(text, i)
      end = match.end() if match else len(text)
      out.append(text[i:end])
      i = end
      continue
    match = _REFERENCE.match(text, i) if char in "@%" else None
    if match:
      sign, name, call = match.groups()
      found.append(Reference(name, bool(call)) if sign == "@" else _Macro(name))
      out.append(repr(f"{_PLACEHOLDER}{len(found) - 1}"))
      i = match.end()
      continue
    out.append(char)
    i += 1
  try:
    return _replace(ast.literal_eval("".join(out)), found)
  except (ValueError, SyntaxError, TypeError):
    raise UserError(f"{where}: '{text}' is not a gin value t5lite-import can read; fix "
                    "config.gin or move it away to import the model alone.") from None


def _resolve(value: Any, macros: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
  """`value` with every `%MACRO` of the file replaced by its value."""
  if isinstance(value, _Macro):
    if value.name not in macros:
      return Constant(value.name)
    if value.name in seen:
      raise UserError(f"Macro {value.name} refers to itself through {' -> '.join(seen)}.")
    return _resolve(macros[value.name], macros, seen + (value.name,))
  if isinstance(value, (tuple, list)):
    return type(value)(_resolve(v, macros, seen) for v in value)
  if isinstance(value, dict):
    return {k: _resolve(v, macros, seen) for k, v in value.items()}
  return value


def parse(text: str, path: str) -> OperativeConfig:
  """Parses a T5X operative config.

  Args:
    text: the contents of T5X's config.gin.
    path: its file, for messages.

  Returns:
    The macros (resolved) and the bindings, in the file's order.

  Raises:
    ValueError: a statement that is neither an import, a macro nor a
      binding, a value that is not a gin literal, or a macro cycle.
  """
  # A later binding of the same name wins, as in gin.
  raw_macros, raw_bindings = {}, {}
  for number, statement in _statements(text, path):
    if re.match(r"(import|from)\s", statement):
      continue
    where = f"{path} line {number}"
    key, equals, value_text = statement.partition("=")
    match = _KEY.fullmatch(key.strip())
    if not equals or not match:
      raise UserError(f"{where}: '{statement[:80]}' is not a binding t5lite-import reads "
                      "(NAME = value or [scope/]module.Class.param = value); fix config.gin or "
                      "move it away to import the model alone.")
    scope, name = match.group(1).rstrip("/"), match.group(2)
    value = _value(value_text.strip(), where)
    if "." not in name:
      raw_macros[name] = value
    else:
      configurable, param = name.rsplit(".", 1)
      raw_bindings[(scope, configurable, param)] = value
  macros = {name: _resolve(value, raw_macros, (name,)) for name, value in raw_macros.items()}
  bindings = tuple(Binding(scope, configurable, param, _resolve(value, raw_macros))
                   for (scope, configurable, param), value in raw_bindings.items())
  return OperativeConfig(path, macros, bindings)


# ---------------------------------------------------------------------------
# Mapping onto t5lite

_ADAFACTOR_ARGS = ("factored", "multiply_by_parameter_scale", "beta1", "decay_rate",
                   "step_offset", "clipping_threshold", "weight_decay_rate",
                   "min_dim_size_to_factor", "epsilon1", "epsilon2", "dtype_momentum",
                   "logical_factor_rules", "weight_decay_rate_lr_exponent",
                   "global_norm_clip_threshold", "max_parameter_scale", "skip_nan_updates")
# T5X's standard rules (adafactor) and its MoE rules (adafactor_utils); t5lite's
# standard rules hold both.
_FACTOR_RULES = ("standard_logical_factor_rules", "logical_factor_rules")
_SCHEDULE_ARGS = ("factors", "base_learning_rate", "warmup_steps", "decay_factor",
                  "steps_per_decay", "steps_per_cycle", "step_offset", "min_learning_rate")
_SPECIAL_FACTORS = ("NUM_REAL_TARGET_TOKENS", "NUM_TOTAL_TARGET_TOKENS", "AVERAGE_PER_SEQUENCE")
_DTYPES = ("float32", "bfloat16", "float16")
_NETWORK_CONFIGS = ("T5Config", "TransformerConfig")
_MODEL_SECTION = ("vocab_size", "emb_dim", "num_heads", "num_encoder_layers",
                  "num_decoder_layers", "num_layers", "head_dim", "mlp_dim", "mlp_activations",
                  "logits_via_embedding", "num_buckets")
_DATA_MACROS = {"mixture_or_task_name": "MIXTURE_OR_TASK_NAME",
                "task_feature_lengths": "TASK_FEATURE_LENGTHS", "batch_size": "BATCH_SIZE",
                "module": "MIXTURE_OR_TASK_MODULE", "use_cached": "USE_CACHED_TASKS"}
_DATA_FIELDS = ("split", "shuffle", "seed", "pack", "use_memory_cache", "trim_output_features")
_TRAIN_MACROS = {"eval_period": "EVAL_PERIOD", "eval_steps": "EVAL_STEPS",
                 "stats_period": "STATS_PERIOD", "random_seed": "RANDOM_SEED"}
_TRAIN_ARGS = ("gc_period", "run_eval_before_training")
_SAVE_MACROS = {"period": "CHECKPOINT_PERIOD", "keep": "CHECKPOINTS_TO_KEEP"}
_SAVE_ARGS = ("dtype", "save_dataset", "checkpoint_steps")

# Wiring (t5lite's run file connects its own objects; the model section has
# the vocabulary) and the user's (where the run goes, how long it is).
_WIRING_AND_USERS = {
    ("train", "model"), ("train", "checkpoint_cfg"), ("train", "partitioner"),
    ("train", "summarize_config_fn"), ("CheckpointConfig", "save"),
    ("CheckpointConfig", "restore"), ("Transformer", "config"), ("DecoderWrapper", "config"),
    ("SentencePieceVocabulary", "sentencepiece_model_file"),
    ("train", "model_dir"), ("train", "total_steps"), ("train", "relative_steps")}
# (configurable, param) -> whether a value asks for what t5lite does anyway.
_SAME_AS_T5LITE = {
    ("train", "trainer_cls"): lambda v: isinstance(v, Reference) and v.name.endswith(".Trainer"),
    ("train", "use_hardware_rng"): lambda v: v is False,
    ("PjitPartitioner", "model_parallel_submesh"): lambda v: v is None,
    ("PjitPartitioner", "logical_axis_rules"): lambda v: (
        isinstance(v, Reference) and v.called and v.name.endswith(".standard_logical_axis_rules")),
    ("DatasetConfig", "use_custom_packing_ops"): lambda v: v is False,
    # The model section has T5's relative-position distance and 100 extra ids.
    ("T5Config", "max_distance"): lambda v: v == 128,
    ("TransformerConfig", "max_distance"): lambda v: v == 128,
    ("ByteVocabulary", "extra_ids"): lambda v: v == 100,
    ("SentencePieceVocabulary", "extra_ids"): lambda v: v == 100,
}
# How the T5X run started; the file starts from the imported checkpoint.
_SUPERSEDED = ("RestoreCheckpointConfig",)

_LAYOUT = ("memory and speed, not the math; t5lite's TransformerConfig has its own "
           "scan_layers and remat_policy")
_REASONS = {
    ("train", "use_hardware_rng"): "t5lite draws random numbers with JAX's default generator",
    ("PjitPartitioner", "model_parallel_submesh"):
        "t5lite shapes its mesh with NUM_MODEL_PARTITIONS or a gin/partitioning/ preset",
    ("PjitPartitioner", "logical_axis_rules"):
        "t5lite's logical axis rules come from gin/partitioning/ presets",
    ("Adafactor", "factor_map"):
        "t5lite factors by logical axes (logical_factor_rules), not by parameter names",
    ("Adafactor", "multiply_by_parameter_scale"):
        "T5X's HParamMap rules; t5lite's optimizers.adafactor takes (regex, bool) pairs",
    ("Adafactor", "logical_factor_rules"):
        "only T5X's standard and MoE factor rules are carried; t5lite's standard ones apply",
    ("Adafactor", "learning_rate"): "the schedule (Trainer.learning_rate_fn) sets the rate",
    ("Trainer", "learning_rate_fn"): "only utils.create_learning_rate_scheduler is carried; "
                                     "LEARNING_RATE is a constant instead",
    ("optimizer_def",): "only adafactor.Adafactor is carried; t5lite's optimizers.adafactor "
                        "with T5X's defaults trains instead",
    ("T5Config", "max_distance"): "the model section has relative_attention_max_distance "
                                  "= 128; set it to this",
    ("TransformerConfig", "max_distance"): "the model section has "
                                           "relative_attention_max_distance = 128; set it to this",
    ("T5Config", "scan_layers"): _LAYOUT, ("T5Config", "remat_policy"): _LAYOUT,
    ("T5Config", "param_scan_axis"): _LAYOUT,
    ("ByteVocabulary", "extra_ids"): "the model section's vocabulary has 100 extra ids",
    ("SentencePieceVocabulary", "extra_ids"): "the model section's vocabulary has 100 extra ids",
}
_DECODING = "decoding at inference, not training; t5lite's models take decode_fn"
_REFERENCE_VALUE = "its value is a T5X reference, which has no t5lite counterpart"
_NO_COUNTERPART = "t5lite has no such setting"


class _Bindings:
  """A config's bindings, each taken at most once: what is left at the end
  was not carried."""

  def __init__(self, config: OperativeConfig):
    self._left = list(config.bindings)

  def take(self, kind: str, param: str, scope: str = "") -> Binding | None:
    for binding in self._left:
      if (binding.kind, binding.param, binding.scope) == (kind, param, scope):
        self._left.remove(binding)
        return binding
    return None

  def take_all(self, kind: str, scope: str = "") -> list[Binding]:
    taken = [b for b in self._left if b.kind == kind and b.scope == scope]
    self._left = [b for b in self._left if b not in taken]
    return taken

  def left(self) -> list[Binding]:
    return list(self._left)


def _is_literal(value: Any) -> bool:
  if isinstance(value, (Reference, Constant)):
    return False
  if isinstance(value, (tuple, list)):
    return all(_is_literal(v) for v in value)
  if isinstance(value, dict):
    return all(_is_literal(k) and _is_literal(v) for k, v in value.items())
  return True


def _calls(value: Any, name: str) -> bool:
  """Whether `value` is `@<module>.<name>()`."""
  return isinstance(value, Reference) and value.called and value.name.rsplit(".", 1)[-1] == name


def _omit(binding: Binding, reason: str | None = None) -> gin_file.Omission:
  if reason is None:
    decoding = binding.param == "decode_fn" or binding.configurable.startswith("decoding.")
    reason = (_REASONS.get((binding.kind, binding.param)) or _REASONS.get((binding.param,))
              or (_DECODING if decoding else None)
              or (_REFERENCE_VALUE if not _is_literal(binding.value) else _NO_COUNTERPART))
  return gin_file.Omission(binding.key, gin_file.literal(binding.value), reason)


@dataclasses.dataclass
class _Part:
  """The settings of one section and the bindings it could not carry."""

  settings: list[gin_file.Setting] = dataclasses.field(default_factory=list)
  omitted: list[gin_file.Omission] = dataclasses.field(default_factory=list)

  def add(self, name: str, value: Any, *comment: str) -> None:
    self.settings.append(gin_file.Setting(name, value, comment))

  def carry(self, name: str, binding: Binding) -> None:
    """`name = <binding's value>` when that value is a literal, else an omission."""
    if _is_literal(binding.value):
      self.add(name, binding.value)
    else:
      self.omitted.append(_omit(binding))


def _dtype_name(value: Any) -> str | None:
  """'bfloat16' for 'bfloat16', `%jnp.bfloat16` or `@jax.numpy.bfloat16`."""
  name = value if isinstance(value, str) else getattr(value, "name", "")
  name = name.rsplit(".", 1)[-1] if isinstance(name, str) else ""
  return name if name in _DTYPES else None


def _adafactor_arg(part: _Part, binding: Binding) -> None:
  name = f"optimizers.adafactor.{binding.param}"
  value = binding.value
  if binding.param == "multiply_by_parameter_scale" and not isinstance(value, bool):
    part.omitted.append(_omit(binding))
  elif binding.param == "logical_factor_rules":
    if value is None:
      part.add(name, None)
    elif any(_calls(value, rules) for rules in _FACTOR_RULES):
      part.add(name, gin_file.Ref("@optimizers.standard_logical_factor_rules()"))
    else:
      part.omitted.append(_omit(binding))
  elif binding.param == "dtype_momentum" and _dtype_name(value):
    part.add(name, _dtype_name(value))
  elif binding.param in _ADAFACTOR_ARGS and binding.param != "dtype_momentum":
    part.carry(name, binding)
  else:
    part.omitted.append(_omit(binding))


def _optimizer(bindings: _Bindings, model_kind: str) -> _Part:
  """OPTIMIZER: T5X's Adafactor, argument for argument."""
  part = _Part()
  part.add("OPTIMIZER", gin_file.Ref("@optimizers.adafactor()"))
  part.add("optimizers.adafactor.learning_rate", gin_file.Ref("%LEARNING_RATE"))
  optimizer = bindings.take(model_kind, "optimizer_def")
  arguments = []
  if optimizer is not None and not _calls(optimizer.value, "Adafactor"):
    part.omitted.append(_omit(optimizer))
  else:
    arguments = bindings.take_all("Adafactor")
  for binding in arguments:
    _adafactor_arg(part, binding)
  if not any(binding.param == "logical_factor_rules" for binding in arguments):
    part.add("optimizers.adafactor.logical_factor_rules", None,
             "T5X's default: no factor rules, its size heuristic alone (t5lite's default is "
             "the standard rules).")
  return part


def _schedule(bindings: _Bindings) -> _Part:
  """LEARNING_RATE: T5X's create_learning_rate_scheduler, or a constant."""
  part = _Part()
  rate_fn = bindings.take("Trainer", "learning_rate_fn")
  if rate_fn is None or not _calls(rate_fn.value, "create_learning_rate_scheduler"):
    if rate_fn is not None:
      part.omitted.append(_omit(rate_fn))
    part.add("LEARNING_RATE", 0.001, "T5X's schedule is not carried (see the end of the "
             "file): a constant rate; set your own.")
    return part
  part.add("LEARNING_RATE", gin_file.Ref("@optimizers.create_learning_rate_scheduler()"))
  for binding in bindings.take_all("create_learning_rate_scheduler"):
    if binding.param in _SCHEDULE_ARGS:
      part.carry(f"optimizers.create_learning_rate_scheduler.{binding.param}", binding)
    else:
      part.omitted.append(_omit(binding))
  return part


def _loss_normalizing_factor(value: Any) -> tuple[bool, Any]:
  """(understood, t5lite's value) of a T5X loss_normalizing_factor."""
  if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
    return True, value
  name = value if isinstance(value, str) else getattr(value, "name", "")
  name = name.rsplit(".", 1)[-1].upper() if isinstance(name, str) else ""
  return name in _SPECIAL_FACTORS, name


def _loss(bindings: _Bindings, model_kind: str, t5lite_model: str) -> _Part:
  """The model's loss settings, T5X's defaults written where unbound."""
  part = _Part()
  prefix = f"models.{t5lite_model}."
  for param in ("z_loss", "label_smoothing"):
    binding = bindings.take(model_kind, param)
    if binding is None:
      part.add(prefix + param, 0.0)
    else:
      part.carry(prefix + param, binding)
  binding = bindings.take(model_kind, "loss_normalizing_factor")
  understood, value = _loss_normalizing_factor(None if binding is None else binding.value)
  if not understood:
    part.omitted.append(_omit(binding, "not one of T5X's loss normalizing factors"))
  elif value is None:
    part.add(prefix + "loss_normalizing_factor", None,
             "T5X sums the loss over the batch's target tokens (None); t5lite's own gin files "
             "average it per target token ('NUM_REAL_TARGET_TOKENS').")
  else:
    part.add(prefix + "loss_normalizing_factor", value)
  binding = bindings.take(model_kind, "inputs_bidirectional_attention")
  if binding is not None:
    part.carry(prefix + "inputs_bidirectional_attention", binding)
  return part


def _network(bindings: _Bindings) -> _Part:
  """Dropout, activation dtype and attention-logit precision (T5X's defaults
  where unbound: 0.1, float32 and False in every T5X example network)."""
  part = _Part()
  found = {}
  for kind in _NETWORK_CONFIGS:
    for binding in bindings.take_all(kind):
      if binding.param in ("dropout_rate", "dtype", "float32_attention_logits"):
        found[binding.param] = binding
      elif binding.param not in _MODEL_SECTION:
        part.omitted.append(_omit(binding))
  dropout, dtype, logits = (found.get(p) for p in ("dropout_rate", "dtype",
                                                    "float32_attention_logits"))
  if dropout is None:
    part.add("DROPOUT_RATE", 0.1)
  elif _is_literal(dropout.value):
    part.add("DROPOUT_RATE", dropout.value)
  else:
    # The model section needs one.
    part.omitted.append(_omit(dropout))
    part.add("DROPOUT_RATE", gin_file.Ref("%gin.REQUIRED"), "T5X's is not carried: set it.")
  if dtype is not None and _dtype_name(dtype.value) is None:
    part.omitted.append(_omit(dtype, f"t5lite computes in {', '.join(_DTYPES)}"))
  else:
    part.add("transformer.TransformerConfig.dtype",
             "float32" if dtype is None else _dtype_name(dtype.value))
  if logits is None:
    part.add("transformer.TransformerConfig.float32_attention_logits", False)
  else:
    part.carry("transformer.TransformerConfig.float32_attention_logits", logits)
  return part


def _dataset_scope(bindings: _Bindings, role: str, part: _Part) -> str | None:
  """The T5X scope of the DatasetConfig that train()'s `<role>_dataset_cfg`
  names; None (written as such) when the run had none."""
  binding = bindings.take("train", f"{role}_dataset_cfg")
  value = None if binding is None else binding.value
  if isinstance(value, Reference) and value.name.rsplit(".", 1)[-1] == "DatasetConfig":
    return value.name.split("/")[0] if "/" in value.name else ""
  if value is not None:
    part.omitted.append(_omit(binding))
  elif role == "infer_eval":
    part.add("INFER_EVAL_DATASET_CFG", None)
  elif role == "train_eval":
    part.add("train_lib.train.train_eval_dataset_cfg", None)
  return None


def _dataset(bindings: _Bindings, role: str, scope: str, part: _Part,
             train_values: dict[str, Any]) -> None:
  """One DatasetConfig: the training one through the run file's macros,
  others only where they differ from it."""
  prefix = f"{role}/datasets.DatasetConfig."
  found = bindings.take_all("DatasetConfig", scope)
  for binding in found:
    if binding.param in _DATA_MACROS and role == "train":
      comment = ()
      if binding.param == "mixture_or_task_name":
        comment = ("T5X's task: it must be registered for t5lite too (t5lite's own tasks are; "
                   "for another, set MIXTURE_OR_TASK_MODULE to the module that registers it).",)
      if _is_literal(binding.value):
        train_values[binding.param] = binding.value
        part.add(_DATA_MACROS[binding.param], binding.value, *comment)
      else:
        part.omitted.append(_omit(binding))
    elif binding.param in _DATA_MACROS:
      if binding.value != train_values.get(binding.param):
        part.carry(prefix + binding.param, binding)
    elif binding.param in _DATA_FIELDS:
      part.carry(prefix + binding.param, binding)
    elif not _nothing_to_carry(binding):
      part.omitted.append(_omit(binding))
  if not any(b.param == "pack" for b in found):
    # t5lite's run file packs; T5X's DatasetConfig does not by default.
    part.add(prefix + "pack", False, "T5X's default: not packed.")


def _data(bindings: _Bindings) -> _Part:
  """The task, lengths and batch, and each dataset's split, order and packing."""
  part = _Part()
  train_values: dict[str, Any] = {}
  for role in ("train", "train_eval", "infer_eval"):
    scope = _dataset_scope(bindings, role, part)
    if scope is not None:
      _dataset(bindings, role, scope, part, train_values)
  part.settings.sort(key=lambda setting: "." in setting.name)  # macros first
  return part


def _run(bindings: _Bindings) -> _Part:
  """The loop's periods and seed, checkpoint saving, microbatches, partitions."""
  part = _Part()
  for param, macro in _TRAIN_MACROS.items():
    if (binding := bindings.take("train", param)) is not None:
      part.carry(macro, binding)
  for param in _TRAIN_ARGS:
    if (binding := bindings.take("train", param)) is not None:
      part.carry(f"train_lib.train.{param}", binding)
  for param, macro in _SAVE_MACROS.items():
    if (binding := bindings.take("SaveCheckpointConfig", param)) is not None:
      part.carry(macro, binding)
  for param in _SAVE_ARGS:
    binding = bindings.take("SaveCheckpointConfig", param)
    if binding is not None and not (param == "checkpoint_steps" and binding.value is None):
      part.carry(f"checkpoints.SaveCheckpointConfig.{param}", binding)
  if (binding := bindings.take("Trainer", "num_microbatches")) is not None:
    part.carry("trainer.Trainer.num_microbatches", binding)
  binding = bindings.take("PjitPartitioner", "num_partitions")
  if binding is not None and binding.value is not None:
    part.carry("NUM_MODEL_PARTITIONS", binding)
  return part


def _start(step_dir: str) -> _Part:
  part = _Part()
  part.add("INITIAL_CHECKPOINT_PATH", step_dir,
           "Fine-tunes from the checkpoint's parameters: the optimizer state starts fresh, at "
           "step 0 (gin/runs/finetune.gin). To continue the T5X run itself instead, its "
           "Adafactor state and step, add:",
           "  checkpoints.RestoreCheckpointConfig.params_only = False")
  return part


def _nothing_to_carry(binding: Binding) -> bool:
  """Whether a binding is wiring, the user's, superseded, or asks for what
  t5lite does anyway (see the module docstring)."""
  key = (binding.kind, binding.param)
  same = _SAME_AS_T5LITE.get(key)
  return (binding.kind in _SUPERSEDED or key in _WIRING_AND_USERS
          or (same is not None and same(binding.value)))


def _model_kind(bindings: _Bindings, t5lite_model: str) -> str:
  """The T5X model class the run trained (`train.model`), by its own name."""
  model = bindings.take("train", "model")
  if model is not None and isinstance(model.value, Reference):
    return model.value.name.rsplit(".", 1)[-1]
  return t5lite_model


def recipe(config: OperativeConfig, network: str, step_dir: str) -> gin_file.Recipe:
  """The t5lite training recipe of a T5X run.

  Args:
    config: the run's parsed config.gin.
    network: `gin_file.ENCODER_DECODER` or `DECODER_ONLY` (from the arrays).
    step_dir: the imported checkpoint, where training starts.

  Returns:
    Sections of t5lite settings and every T5X binding not carried, with why.
  """
  t5lite_model = ("EncoderDecoderModel" if network == gin_file.ENCODER_DECODER
                  else "DecoderOnlyModel")
  bindings = _Bindings(config)
  model_kind = _model_kind(bindings, t5lite_model)
  for param in ("module", "input_vocabulary", "output_vocabulary", "vocabulary"):
    bindings.take(model_kind, param)  # the model section's
  parts = {"Optimizer (T5X's adafactor.Adafactor)": _optimizer(bindings, model_kind),
           "Learning rate (T5X's Trainer.learning_rate_fn)": _schedule(bindings),
           f"Loss (T5X's {model_kind})": _loss(bindings, model_kind, t5lite_model),
           "Network": _network(bindings),
           "Data": _data(bindings),
           "Loop, checkpoints and partitioning": _run(bindings),
           "Start": _start(step_dir)}
  omitted = [o for part in parts.values() for o in part.omitted]
  omitted += [_omit(b) for b in bindings.left() if not _nothing_to_carry(b)]
  sections = tuple((title, tuple(part.settings)) for title, part in parts.items()
                   if part.settings)
  return gin_file.Recipe(config.path, sections, tuple(omitted))


def for_checkpoint(path: str, network: str) -> gin_file.Recipe | None:
  """The training recipe of the T5X run a checkpoint belongs to.

  Args:
    path: a T5X step directory or the directory holding them.
    network: as `recipe` takes it.

  Returns:
    The recipe, or None when no config.gin sits next to the checkpoint.

  Raises:
    ValueError: a config.gin that is not a T5X operative config.
  """
  step_dir = t5x.find_step_dir(path)
  config_path, text = t5x.operative_config(step_dir)
  if config_path is None:
    return None
  return recipe(parse(text, config_path), network, step_dir)
