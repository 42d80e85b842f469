"""SeqIO tasks over the user's own TSV or JSON Lines files, declared in gin.

`register_file_task` turns files of examples, one a line with named fields,
into a registered seqio Task and returns its name, so that a gin file can
say `MIXTURE_OR_TASK_NAME = @file_tasks.register_file_task()` and train on
its own data without a Python module.

- TSV (`.tsv`): the first line of each file is a header naming its fields,
  separated by tabs; every other line has one value per field. No quoting:
  a value cannot hold a tab or a line break (JSON Lines can).
- JSON Lines (`.jsonl`, `.json`): one JSON object a line; the fields used
  must be strings.

Blank lines are skipped. Every file is read and checked when the task is
declared, before anything is compiled or written: a missing file, a line
that does not parse or a missing field stops the run with one line naming
the file and the line (numbered from 1, as an editor numbers them). The
examples are then kept in memory (and in every saved data iterator, with
`save_dataset`).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import seqio
import tensorflow as tf

from t5lite.data import tasks, vocabularies
from t5lite.errors import UserError


FORMATS = ("tsv", "jsonl")
_EXTENSIONS = {".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}
_GLOB_CHARACTERS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class FileTaskSpec:
  """What a file task reads and how; two declarations are the same task iff equal.

  Attributes:
    name: the task's name.
    splits: (split, file patterns) pairs, in the order given.
    inputs_field: the field that becomes `inputs`; None for a task with
      `targets` alone (decoder-only language models).
    targets_field: the field that becomes `targets`.
    vocabulary: the vocabulary of both features.
    format: 'tsv' or 'jsonl' for every file; None reads each file's
      extension.
    strip: drop whitespace around each value.
    inputs_prefix: text put before each input (after stripping).
    metrics: names of the inference-eval metrics, see `available_metrics`.
  """

  name: str
  splits: tuple[tuple[str, tuple[str, ...]], ...]
  inputs_field: str | None
  targets_field: str
  vocabulary: seqio.Vocabulary
  format: str | None
  strip: bool
  inputs_prefix: str
  metrics: tuple[str, ...]

  @property
  def fields(self) -> tuple[str, ...]:
    """The fields read from each line: the inputs' (if any), then the targets'."""
    return (self.targets_field,) if self.inputs_field is None else (
        self.inputs_field, self.targets_field)

  @property
  def features(self) -> tuple[str, ...]:
    """The task's features, in the order of `fields`."""
    return ("targets",) if self.inputs_field is None else ("inputs", "targets")


# ---------------------------------------------------------------------------
# Metrics


def _bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Corpus BLEU (0-100) with sacrebleu's international tokenizer, as T5 reports it."""
  import sacrebleu  # Optional: only `available_metrics` offers this metric.
  score = sacrebleu.corpus_bleu(list(predictions), [list(targets)], tokenize="intl")
  return {"bleu": score.score}


_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def _rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """ROUGE-1, -2 and -L F-measures (0-100), averaged over the examples."""
  from rouge_score import rouge_scorer  # Optional: only `available_metrics` offers this metric.
  scorer = rouge_scorer.RougeScorer(list(_ROUGE_TYPES))
  scores = [scorer.score(target, prediction) for target, prediction in zip(targets, predictions)]
  return {kind: 100.0 * float(np.mean([s[kind].fmeasure for s in scores])) if scores else 0.0
          for kind in _ROUGE_TYPES}


# Metric name -> (the package it needs, or None; the seqio metric function).
_METRICS: dict[str, tuple[str | None, Callable[..., dict[str, float]]]] = {
    "exact_match": (None, tasks.exact_match_accuracy),
    "bleu": ("sacrebleu", _bleu),
    "rouge": ("rouge_score", _rouge),
}


def available_metrics() -> tuple[str, ...]:
  """The metric names this installation can compute (BLEU and ROUGE need
  the sacrebleu and rouge_score packages)."""
  return tuple(name for name, (package, _) in _METRICS.items()
               if package is None or importlib.util.find_spec(package) is not None)


def _metric_fns(names: tuple[str, ...]) -> list[Callable[..., dict[str, float]]]:
  return [_METRICS[name][1] for name in names]


# ---------------------------------------------------------------------------
# Checking the declaration


def _check_fields(inputs_field: object, targets_field: object) -> None:
  for what, field in (("inputs_field", inputs_field), ("targets_field", targets_field)):
    if field is None and what == "inputs_field":
      continue
    if not isinstance(field, str) or not field:
      raise UserError(f"{what} must be the name of a field of your files, got {field!r}.")
  if inputs_field == targets_field:
    raise UserError(f"inputs_field and targets_field are both '{targets_field}'; name two "
                    "different fields.")


def _check_splits(splits: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """{split: pattern or [patterns]} as (split, patterns) pairs."""
  example = "{'train': 'data/train.tsv', 'validation': 'data/dev.tsv'}"
  if not isinstance(splits, Mapping) or not splits:
    raise UserError(f"splits must be a non-empty dict of split -> file pattern, got "
                    f"{splits!r}, e.g. {example}.")
  pairs = []
  for split, patterns in splits.items():
    patterns = (patterns,) if isinstance(patterns, str) else patterns
    if (not isinstance(split, str) or not split or not isinstance(patterns, Sequence)
        or not patterns or not all(isinstance(p, str) and p for p in patterns)):
      raise UserError(f"splits[{split!r}] must be a file pattern or a list of them, got "
                      f"{splits[split]!r}, e.g. {example}.")
    pairs.append((split, tuple(patterns)))
  return tuple(pairs)


def _check_metrics(metrics: object) -> tuple[str, ...]:
  available = available_metrics()
  if isinstance(metrics, str) or not isinstance(metrics, Sequence):
    raise UserError(f"metrics must be a list of metric names, got {metrics!r}; available: "
                    f"{', '.join(available)}.")
  for name in metrics:
    if name not in available:
      needs = _METRICS[name][0] if isinstance(name, str) and name in _METRICS else None
      why = f"needs the {needs} package, which is not installed" if needs else "is unknown"
      raise UserError(f"Metric {name!r} {why}; available: {', '.join(available)}.")
  return tuple(metrics)


def _spec(declared: dict[str, Any]) -> FileTaskSpec:
  """The checked declaration (`register_file_task`'s arguments by name), or a
  UserError naming the first bad argument."""
  name, inputs_field, vocabulary = (declared["name"], declared["inputs_field"],
                                    declared["vocabulary"])
  format, strip, inputs_prefix = declared["format"], declared["strip"], declared["inputs_prefix"]
  if not isinstance(name, str) or not name:
    raise UserError(f"A file task needs a name (a non-empty string), got {name!r}.")
  _check_fields(inputs_field, declared["targets_field"])
  if format is not None and format not in FORMATS:
    raise UserError(f"Unknown file format {format!r}; use one of {', '.join(FORMATS)}, or "
                    "None to read each file's extension.")
  if not isinstance(strip, bool):
    raise UserError(f"strip must be True or False, got {strip!r}.")
  if not isinstance(inputs_prefix, str):
    raise UserError(f"inputs_prefix must be a string, got {inputs_prefix!r}.")
  if vocabulary is not None and not isinstance(vocabulary, seqio.Vocabulary):
    raise UserError(f"vocabulary must be a seqio vocabulary such as %VOCABULARY (the model's), "
                    f"got {vocabulary!r}.")
  if inputs_prefix and inputs_field is None:
    raise UserError("inputs_prefix needs an inputs_field; a task without one has targets only.")
  return FileTaskSpec(
      name=name, splits=_check_splits(declared["splits"]), inputs_field=inputs_field,
      targets_field=declared["targets_field"],
      vocabulary=vocabulary if vocabulary is not None else vocabularies.byte_vocabulary(),
      format=format, strip=strip, inputs_prefix=inputs_prefix,
      metrics=_check_metrics(declared["metrics"]))


# ---------------------------------------------------------------------------
# Finding and reading the files


def _expand(split: str, pattern: str) -> list[str]:
  """The files a pattern names, sorted; a UserError when there are none."""
  if not _GLOB_CHARACTERS & set(pattern):
    if not os.path.isfile(pattern):
      state = "is a directory" if os.path.isdir(pattern) else "does not exist"
      raise UserError(f"Data file '{pattern}' (split '{split}') {state} (working directory "
                      f"{os.getcwd()}); give the path of a file, or a glob pattern.")
    return [pattern]
  found = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
  if not found:
    raise UserError(f"Pattern '{pattern}' (split '{split}') matches no file (working "
                    f"directory {os.getcwd()}); check the path.")
  return found


def _files(spec: FileTaskSpec) -> dict[str, list[str]]:
  """split -> its files in pattern order, each once."""
  return {split: list(dict.fromkeys(path for pattern in patterns
                                    for path in _expand(split, pattern)))
          for split, patterns in spec.splits}


def _file_format(path: str, format: str | None) -> str:
  if format is not None:
    return format
  extension = os.path.splitext(path)[1].lower()
  if extension not in _EXTENSIONS:
    raise UserError(f"Cannot tell the format of '{path}' from its extension; name it .tsv or "
                    f".jsonl, or set format to one of {', '.join(FORMATS)}.")
  return _EXTENSIONS[extension]


def _lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number from 1, text without its line break) for each non-blank line."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        text = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise UserError(f"{path}, line {number}: not UTF-8 text (byte {e.start + 1} of the "
                        "line); save the file as UTF-8.") from e
      if text.strip():
        yield number, text


def _read_tsv(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
  """The values of `fields` on each line of a TSV file with a header line."""
  lines = _lines(path)
  header_line, header_text = next(lines, (None, ""))
  if header_line is None:
    raise UserError(f"{path}: the file is empty; a TSV file starts with a header line naming "
                    "its fields, separated by tabs.")
  header = header_text.split("\t")
  missing = [field for field in fields if field not in header]
  if missing:
    raise UserError(f"{path}, line {header_line}: the header names no field "
                    f"{', '.join(repr(m) for m in missing)} (it names "
                    f"{', '.join(repr(h) for h in header)}); name the fields in the first line, "
                    "separated by tabs, or set inputs_field/targets_field to header names.")
  columns = [header.index(field) for field in fields]
  for number, text in lines:
    values = text.split("\t")
    if len(values) != len(header):
      absent = ", ".join(repr(h) for h in header[len(values):]) or "none"
      raise UserError(f"{path}, line {number}: {len(values)} tab-separated value(s) but the "
                      f"header (line {header_line}) names {len(header)} fields (missing: "
                      f"{absent}); give every line one value per field, separated by tabs.")
    yield tuple(values[column] for column in columns)


_JSON_TYPES = {dict: "an object", list: "an array", int: "a number", float: "a number",
               bool: "true/false", type(None): "null"}


def _read_jsonl(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
  """The values of `fields` on each line of a JSON Lines file."""
  for number, text in _lines(path):
    where = f"{path}, line {number}"
    try:
      example = json.loads(text)
    except json.JSONDecodeError as e:
      hint = (" (a JSON array is not JSON Lines)" if number == 1 and text.lstrip()[:1] == "["
              else "")
      raise UserError(f"{where}: not valid JSON{hint}: {e.msg} at column {e.colno}; write one "
                      "JSON object per line.") from e
    if not isinstance(example, dict):
      raise UserError(f"{where}: {_JSON_TYPES.get(type(example), 'a string')}, not an object; "
                      "write one JSON object per line, e.g. "
                      '{"inputs": "...", "targets": "..."}.')
    values = []
    for field in fields:
      if field not in example:
        raise UserError(f"{where}: no field '{field}' (the line has "
                        f"{', '.join(repr(k) for k in example) or 'no fields'}); give every "
                        "line each field, or set inputs_field/targets_field.")
      if not isinstance(example[field], str):
        raise UserError(f"{where}: field '{field}' is {_JSON_TYPES[type(example[field])]} "
                        f"({json.dumps(example[field])[:40]}), not a string; quote it.")
      values.append(example[field])
    yield tuple(values)


_READERS = {"tsv": _read_tsv, "jsonl": _read_jsonl}


def _clean(spec: FileTaskSpec, values: tuple[str, ...]) -> tuple[str, ...]:
  """Applies `strip` and `inputs_prefix` to one example's values."""
  if spec.strip:
    values = tuple(value.strip() for value in values)
  if spec.inputs_field is not None:
    values = (spec.inputs_prefix + values[0], *values[1:])
  return values


def _read_split(spec: FileTaskSpec, split: str, paths: list[str]) -> dict[str, tf.Tensor]:
  """feature -> a [examples] string tensor of the split's files, in file order."""
  rows = [_clean(spec, values) for path in paths
          for values in _READERS[_file_format(path, spec.format)](path, spec.fields)]
  if not rows:
    raise UserError(f"Split '{split}' of task '{spec.name}' has no examples (files: "
                    f"{', '.join(paths)}); add lines to them.")
  return {feature: tf.constant(list(column), dtype=tf.string)
          for feature, column in zip(spec.features, zip(*rows))}


# ---------------------------------------------------------------------------
# Registering


def _source(examples: Mapping[str, Mapping[str, tf.Tensor]]) -> seqio.DataSource:
  """A seqio source over the examples in memory, one split each."""
  sizes = {split: int(next(iter(columns.values())).shape[0])
           for split, columns in examples.items()}

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    columns, size = examples[split], sizes[split]
    order = tf.data.Dataset.range(size)
    if shuffle_files and seed is not None:
      # Files are often sorted, so the whole split is reshuffled every epoch.
      # Shuffling positions keeps the buffer (and a saved data iterator) small.
      order = order.shuffle(size, seed=seed, reshuffle_each_iteration=True)
    return order.map(lambda i: {feature: tf.gather(column, i)
                                for feature, column in columns.items()})

  return seqio.FunctionDataSource(dataset_fn, splits=list(examples), num_input_examples=sizes)


def _add_task(spec: FileTaskSpec, examples: Mapping[str, Mapping[str, tf.Tensor]]) -> None:
  seqio.TaskRegistry.remove(spec.name)
  seqio.TaskRegistry.add(
      spec.name,
      source=_source(examples),
      output_features={feature: seqio.Feature(spec.vocabulary, add_eos=True)
                       for feature in spec.features},
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      postprocess_fn=tasks.strip_whitespace,
      metric_fns=_metric_fns(spec.metrics))


def _fingerprint(files: Mapping[str, list[str]]) -> tuple:
  """What says a file changed since it was read: its path, size and time."""
  return tuple((split, path, os.stat(path).st_size, os.stat(path).st_mtime_ns)
               for split, paths in files.items() for path in paths)


# name -> (the declaration, the fingerprint of the files it read).
_DECLARED: dict[str, tuple[FileTaskSpec, tuple]] = {}


def _check_name_free(spec: FileTaskSpec) -> None:
  """A file task may replace itself, never another task or a mixture."""
  declared = _DECLARED.get(spec.name)
  if declared is not None and declared[0] != spec:
    raise UserError(f"File task '{spec.name}' is already declared with other settings "
                    f"({_difference(declared[0], spec)}); give this one another name.")
  if declared is None and (spec.name in seqio.TaskRegistry.names()
                           or spec.name in seqio.MixtureRegistry.names()):
    raise UserError(f"'{spec.name}' is already a registered task or mixture; give the file "
                    "task another name.")


def _difference(old: FileTaskSpec, new: FileTaskSpec) -> str:
  changed = [f.name for f in dataclasses.fields(FileTaskSpec)
             if getattr(old, f.name) != getattr(new, f.name)]
  return ", ".join(f"{name} was {getattr(old, name)!r}" for name in changed)


def register_file_task(name: str,
                       splits: Mapping[str, str | Sequence[str]],
                       inputs_field: str | None = "inputs",
                       targets_field: str = "targets",
                       vocabulary: seqio.Vocabulary | None = None,
                       format: str | None = None,
                       strip: bool = True,
                       inputs_prefix: str = "",
                       metrics: Sequence[str] = ("exact_match",)) -> str:
  """Registers a seqio Task over TSV or JSON Lines files and returns its name.

  Every file is read and checked now. Declaring the same task again (gin
  evaluates the call at each use of the name) reuses what was read unless a
  file changed. From gin:

    MIXTURE_OR_TASK_NAME = @file_tasks.register_file_task()
    file_tasks.register_file_task:
      name = 'my_qa'
      splits = {'train': 'data/train-*.tsv', 'validation': 'data/dev.tsv'}
      inputs_field = 'question'
      targets_field = 'answer'
      vocabulary = %VOCABULARY

  Args:
    name: the task's name.
    splits: split -> a file path or glob pattern, or a list of them;
      relative paths are relative to the working directory.
    inputs_field: the field that becomes the `inputs` feature; None makes
      a task of `targets` alone, for decoder-only language models.
    targets_field: the field that becomes the `targets` feature.
    vocabulary: of both features, the model's (`%VOCABULARY` in gin);
      None is the byte vocabulary.
    format: 'tsv' or 'jsonl' for every file; None tells each file's format
      by its extension (.tsv; .jsonl or .json).
    strip: drop whitespace around every value.
    inputs_prefix: text put before every input, e.g. 'translate: '.
    metrics: inference-eval metrics by name, from `available_metrics()`:
      'exact_match' ({'exact_match': percent}), 'bleu' (needs sacrebleu),
      'rouge' (needs rouge_score).

  Returns:
    `name`, so the call can stand wherever a task name is expected.

  Raises:
    UserError: a bad argument; a pattern that matches no file; a file line
      that does not parse, lacks a field, or holds a non-string value (named
      by file and line); a split without examples; a name taken by another
      task, or by a file task declared with other settings.
  """
  spec = _spec(dict(name=name, splits=splits, inputs_field=inputs_field,
                    targets_field=targets_field, vocabulary=vocabulary, format=format,
                    strip=strip, inputs_prefix=inputs_prefix, metrics=metrics))
  _check_name_free(spec)
  files = _files(spec)
  fingerprint = _fingerprint(files)
  if _DECLARED.get(name) == (spec, fingerprint) and name in seqio.TaskRegistry.names():
    return name
  examples = {split: _read_split(spec, split, paths) for split, paths in files.items()}
  _add_task(spec, examples)
  _DECLARED[name] = (spec, fingerprint)
  return name
