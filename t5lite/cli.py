"""Command-line entry points: t5lite-train, t5lite-eval, t5lite-infer, t5lite-export.

T5X-compatible flags: --gin_file (repeatable, later files win),
--gin_bindings (repeatable, beat files), --gin.NAME=VALUE (same as a
binding), --gin_search_paths. Gin files resolve from the search paths, the
current directory and the installed package, so `--gin_file=gin/...` works
from anywhere. This is the only module that imports gin.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import importlib
import inspect
import os
import re
import sys
import tempfile
import tokenize
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import flags

from t5lite import console, paths, write_errors
from t5lite.errors import UserError


FLAGS = flags.FLAGS

flags.DEFINE_multi_string("gin_file", [], "Gin files to parse, in order; later ones win.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings applied after the files.")
flags.DEFINE_list("gin_search_paths", [], "Extra directories to resolve gin files from.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data directory for tasks that read TFDS.")
flags.DEFINE_list("seqio_additional_cache_dirs", [], "Extra directories of cached SeqIO tasks.")
flags.DEFINE_string("mesh_selector", None,
                    "String matched against Partitioner.mesh_rules (default: the device kind).")
flags.DEFINE_bool("multiprocess_gpu", False,
                  "Start jax.distributed; without the three flags below, take the coordinator, "
                  "process count and index from the cluster environment (SLURM, Open MPI).")
flags.DEFINE_string("coordinator_address", None,
                    "host:port where process 0 serves coordination; the same on every process.")
flags.DEFINE_integer("process_count", None, "Number of processes in the job.")
flags.DEFINE_integer("process_index", None, "Index of this process, 0 .. process_count - 1.")
flags.DEFINE_integer("initialization_timeout", 300,
                     "Seconds to wait for all processes to join before stopping with the "
                     "missing one named.")
flags.DEFINE_bool("dry_run", False,
                  "t5lite-train only: validate the config, build the model and mesh "
                  "abstractly and print parameters, memory per device, partitioning, data "
                  "and the checkpoint/eval schedule; compiles nothing, writes nothing.")
flags.DEFINE_bool("overwrite", False,
                  "t5lite-export only: replace EXPORT_DIR whatever it holds. Without it an "
                  "export goes only to a new or empty folder, or over an earlier export of "
                  "the same checkpoint.")
flags.DEFINE_bool("compilation_cache", True,
                  "Keep compiled programs in JAX's persistent compilation cache, so a restart "
                  "or a rerun of the same configuration loads them instead of compiling; "
                  "--nocompilation_cache turns it off.")
flags.DEFINE_string("compilation_cache_dir", None,
                    "Directory of the compilation cache (default: $JAX_COMPILATION_CACHE_DIR, "
                    "else $XDG_CACHE_HOME/t5lite/jax-compilation, ~/.cache without it); one "
                    "that takes no new files is read and not written.")
flags.DEFINE_integer("heartbeat_timeout", 100,
                     "Seconds without a heartbeat after which a peer counts as dead; the other "
                     "processes then stop, naming it.")

USER_ERROR_EXIT = console.USER_ERROR_EXIT
# A write failed: full or read-only disk, a vanished directory (README, exit status).
IO_ERROR_EXIT = 5
# Whether --verbosity asked for the libraries' own logs, native ones included.
_LIBRARY_LOGS = False
# Command-line bindings get the imports the shipped gin files use, so
# `--gin.VOCABULARY=@vocabularies.sentencepiece_vocabulary()` works even when
# no file referenced that function.
BINDINGS_HEADER = (
    "from __gin__ import dynamic_registration",
    "from t5lite import actions",
    "from t5lite import checkpoints",
    "from t5lite import decoding",
    "from t5lite import optimizers",
    "from t5lite import partitioning",
    "from t5lite import train as train_lib",
    "from t5lite import trainer",
    "from t5lite.data import datasets",
    "from t5lite.data import file_tasks",
    "from t5lite.data import vocabularies",
    "from t5lite.models import models",
    "from t5lite.models import transformer",
)
_GIN_FLAG = re.compile(r"^--gin\.([^=]+)=(.*)$", re.DOTALL)


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
  """Turns each `--gin.NAME=VALUE` into `--gin_bindings=NAME = VALUE`.

  `--gin.train.X=Y` names an argument of `train()` the way messages and docs
  do (e.g. `--gin.train.resume_step=N`); it binds `train_lib.train.X`.

  Args:
    argv: the raw command line.

  Returns:
    argv with gin shorthand flags rewritten, order kept (so a later binding
    still beats an earlier one).
  """
  out = []
  for arg in argv:
    match = _GIN_FLAG.match(arg)
    if match is None:
      out.append(arg)
      continue
    name = match.group(1)
    if name.startswith("train.") and name.count(".") == 1:
      name = f"train_lib.{name}"
    out.append(f"--gin_bindings={name} = {match.group(2)}")
  return out


def package_gin_root() -> str:
  """Directory that contains the shipped `gin/` tree.

  A source checkout (or editable install) has it next to the package; a
  regular install carries a copy in t5lite/_gin_root (see setup.py).
  """
  package = os.path.dirname(os.path.abspath(__file__))
  checkout = os.path.dirname(package)
  if os.path.isfile(os.path.join(checkout, "gin", "runs", "pretrain.gin")):
    return checkout
  return os.path.join(package, "_gin_root")


def gin_search_paths(extra: Sequence[str]) -> list[str]:
  return [*extra, os.getcwd(), package_gin_root()]


def _resolve_file(name: str, search_paths: Sequence[str]) -> str:
  if paths.is_url(name):
    paths.check_scheme("Gin file", name)
    if not paths.Path(name).is_file():
      raise UserError(f"Gin file '{name}' not found; check the path.")
    return name
  if os.path.isabs(name):
    return name
  for root in search_paths:
    candidate = os.path.join(root, name)
    if os.path.exists(candidate):
      return candidate
  raise UserError(f"Gin file '{name}' not found in {list(search_paths)}; "
                  "check the path or add its directory with --gin_search_paths.")


def select_mesh(selector: str) -> None:
  """`--mesh_selector`: the `mesh_selector` argument of the Partitioner the
  run configs build, over whatever the gin files bound."""
  import gin
  with gin.unlock_config():
    gin.bind_parameter("t5lite.partitioning.Partitioner.mesh_selector", selector)


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]) -> None:
  """Parses files then bindings; include statements resolve via the search paths.

  Raises:
    UserError: a file is missing or not valid gin, or the config names an
      unknown configurable, parameter or module alias (the message suggests
      the closest valid name).
  """
  import gin
  for path in search_paths:
    gin.add_config_file_search_path(path)
  # Gin opens files with `open`; a gs:// file (or one it includes) goes through paths.
  gin.config.register_file_reader(_open_url, paths.is_url)
  resolved = [_resolve_file(f, search_paths) for f in files]
  _check_syntax(resolved, bindings)
  # Gin logs an error for every search path an include is not under before it
  # finds the right one; those misses are expected, real failures raise.
  import logging
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.CRITICAL)
  try:
    gin.parse_config_files_and_bindings(
        resolved, [*BINDINGS_HEADER, *bindings] if bindings else [], finalize_config=True)
  except (SyntaxError, tokenize.TokenError) as error:
    # Only an included file can get here: the files and bindings given were
    # checked above.
    raise UserError(_syntax_message(error, getattr(error, "filename", None)
                                     or "a gin file included by another")) from None
  except ValueError as error:  # gin's word for an unknown name or a value it cannot bind
    raise UserError(_gin_name_hint(str(error)) or str(error)) from error
  except (AttributeError, NameError) as error:
    # Gin reports an unresolvable name as AttributeError/NameError; it is
    # still a typo in the user's config, so it takes the user-error path.
    hint = _gin_name_hint(str(error))
    if hint is None and not _is_gin_selector_error(str(error)):
      raise
    raise UserError(hint or str(error)) from error
  finally:
    root.setLevel(level)


def _open_url(path: str) -> Any:
  return paths.Path(path).open()


def _check_syntax(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Gin syntax of each file and binding, checked alone so the error names it.

  Gin parses the bindings as one text after a generated header of imports,
  so its own line numbers point into that header, not at what the user wrote.

  Raises:
    UserError: the first file or binding that is not valid gin.
  """
  for path in files:
    error = _syntax_error(paths.Path(path).read_text())
    if error is not None:
      raise UserError(_syntax_message(error, path))
  for binding in bindings:
    error = _syntax_error(binding)
    if error is not None:
      raise UserError(f"{_as_written(binding)} is not valid gin: {_syntax_text(error)}"
                      f"{_value_hint(error)}")


def _syntax_error(text: str) -> SyntaxError | tokenize.TokenError | None:
  """What gin's parser says of `text`, without resolving any name in it."""
  from gin import config_parser

  class NamesUnresolved(config_parser.ParserDelegate):
    def configurable_reference(self, scoped_configurable_name, evaluate):
      return None

    def macro(self, macro_name):
      return None

  try:
    for _ in config_parser.ConfigParser(text, NamesUnresolved()):
      pass
  except (SyntaxError, tokenize.TokenError) as error:
    return error
  return None


def _syntax_text(error: SyntaxError | tokenize.TokenError) -> str:
  if isinstance(error, tokenize.TokenError):
    return f"{error.args[0]} (unclosed bracket?)."
  if str(error.msg).startswith("malformed node"):  # ast.literal_eval's words for a bare name
    return "Unable to parse value."
  return " ".join(str(error.msg).split()).rstrip(".") + "."


def _syntax_message(error: SyntaxError | tokenize.TokenError, path: str) -> str:
  line = error.lineno if isinstance(error, SyntaxError) else error.args[1][0]
  return f"Gin syntax error at line {line} of {path}: {_syntax_text(error)}"


def _value_hint(error: SyntaxError | tokenize.TokenError) -> str:
  text = str(getattr(error, "msg", ""))
  if "Unable to parse value" in text or "malformed node" in text:
    return (" Values are Python literals: quote strings, e.g. "
            "--gin.MODEL_DIR=\"'runs/x'\", or reference a configurable with @name().")
  return ""


def _as_written(binding: str) -> str:
  """A binding as it appeared on the command line (`--gin.X=Y` is rewritten
  to `X = Y` before gin sees it)."""
  for arg in sys.argv:
    match = _GIN_FLAG.match(arg)
    if match and f"{match.group(1)} = {match.group(2)}" == binding:
      return arg
  return f"--gin_bindings={binding!r}"


# The first line of gin 0.5.0's messages for a name it cannot find.
_UNKNOWN_PARAMETER = re.compile(
    r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'\.")
_UNRESOLVED_SELECTOR = re.compile(
    r"Couldn't resolve selector ([\w.]+); .* has no attribute (\w+)\.")
_NO_CONFIGURABLE = re.compile(r"No configurable matching '([\w.]+)'\.")
_NOT_IMPORTED = re.compile(r"'(\w+)' was not provided by an import statement\.")
_FILE_LOCATION = re.compile(r'In file "([^"]+)", line (\d+)')
_UNSET_MACRO = re.compile(r"No bindings specified for '(\w+)/gin\.macro'")
_UNSET_REQUIRED = re.compile(r"([\w/.]+?)(/macro\.value)? set to `%gin\.REQUIRED` but not "
                             r"subsequently overridden\.")


def _is_gin_selector_error(message: str) -> bool:
  first = message.splitlines()[0] if message else ""
  return bool(_UNRESOLVED_SELECTOR.fullmatch(first) or _NOT_IMPORTED.fullmatch(first))


def _gin_name_hint(message: str) -> str | None:
  """Gin's unknown-name error rewritten to name the closest valid name.

  Args:
    message: the text of the error gin raised while parsing.

  Returns:
    The new message, or None when the error is not about an unknown name or
    the hint cannot be built (the caller then keeps gin's own message).
  """
  try:
    first = message.splitlines()[0]
    if match := _UNKNOWN_PARAMETER.fullmatch(first):
      hint = _unknown_parameter_hint(*match.groups())
    elif match := _UNRESOLVED_SELECTOR.fullmatch(first):
      hint = _unknown_configurable_hint(match.group(1), match.group(2))
    elif match := _NO_CONFIGURABLE.fullmatch(first):
      hint = _unknown_configurable_hint(match.group(1), match.group(1).split(".")[-1])
    elif match := _NOT_IMPORTED.fullmatch(first):
      hint = _unknown_alias_hint(match.group(1), message)
    elif match := _UNSET_MACRO.match(first):
      return (f"Macro {match.group(1)} is used but never set; pass --gin.{match.group(1)}=... "
              "or include a gin file that sets it first (e.g. the training headline before "
              "gin/runs/eval.gin).")
    elif match := _UNSET_REQUIRED.fullmatch(first):
      return _unset_required_hint(match.group(1), is_macro=bool(match.group(2)))
    else:
      return None
  except Exception:  # noqa: BLE001 - a hint must never hide the real error
    return None
  return f"{hint}{_location(message)}"


def _unset_required_hint(name: str, is_macro: bool) -> str:
  what = "Macro" if is_macro else "Parameter"
  return (f"{what} {name} is required (%gin.REQUIRED) but not set; pass --gin.{name}=... "
          "or set it in a gin file given after the run file.")


def _unknown_parameter_hint(selector: str, name: str) -> str:
  valid = _parameter_names(_resolve(selector))
  return (f"Unknown parameter '{name}' of {selector}{_did_you_mean(name, valid)} "
          f"Valid: {', '.join(valid)}.")


def _unknown_configurable_hint(selector: str, missing: str) -> str:
  parts = selector.split(".")
  at = parts.index(missing)
  parent = _resolve(".".join(parts[:at]))
  names = _public_callables(parent)
  candidates = [".".join([*parts[:at], n, *parts[at + 1:]]) for n in names]
  return f"Unknown configurable '{selector}'{_did_you_mean(selector, candidates)}"


def _unknown_alias_hint(alias: str, message: str) -> str:
  if _location(message):  # a gin file: only its own imports count
    return f"'{alias}' was not imported by this gin file; add its import statement."
  aliases = sorted(_header_aliases())
  return (f"Unknown module '{alias}' in a binding{_did_you_mean(alias, aliases)} "
          f"Bindings may use: {', '.join(aliases)}.")


def _did_you_mean(name: str, candidates: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, candidates, n=1)
  return f"; did you mean '{close[0]}'?" if close else "."


def _location(message: str) -> str:
  match = _FILE_LOCATION.search(message)
  return f" (line {match.group(2)} of {match.group(1)})" if match else ""


def _header_aliases() -> dict[str, str]:
  """Alias -> module for the imports in BINDINGS_HEADER, e.g. train_lib -> t5lite.train."""
  aliases = {}
  for line in BINDINGS_HEADER:
    match = re.fullmatch(r"from (t5lite\S*) import (\w+)(?: as (\w+))?", line)
    if match:
      aliases[match.group(3) or match.group(2)] = f"{match.group(1)}.{match.group(2)}"
  return aliases


def _resolve(selector: str) -> object:
  """The object 'alias.Name[.attr]' names, with the shipped gin files' aliases."""
  alias, *attrs = selector.split(".")
  target = importlib.import_module(_header_aliases()[alias])
  for attr in attrs:
    target = getattr(target, attr)
  return target


def _parameter_names(fn_or_cls: object) -> list[str]:
  keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  return [p.name for p in inspect.signature(fn_or_cls).parameters.values() if p.kind in keyword]


def _public_callables(owner: object) -> list[str]:
  # A module's own functions and classes, not the names it imported.
  home = getattr(owner, "__name__", None) if inspect.ismodule(owner) else None
  return sorted(name for name, value in vars(owner).items()
                if not name.startswith("_") and callable(value)
                and (home is None or getattr(value, "__module__", None) == home))


def write_operative_config(model_dir: str) -> None:
  """Writes the gin config that was actually used to MODEL_DIR/config.gin.

  The file is written beside and then renamed into place, so a write that
  fails (a full disk) leaves the config.gin of an earlier run as it was.
  """
  import gin
  paths.write_whole(paths.join(model_dir, "config.gin"), gin.operative_config_str())


def _hide_gpus_from_tensorflow() -> None:
  # TensorFlow only feeds data; left alone it would grab GPU memory JAX needs.
  with _native_start_up_logs_hidden():
    import tensorflow as tf
    tf.config.set_visible_devices([], "GPU")


@contextlib.contextmanager
def _native_start_up_logs_hidden() -> Iterator[None]:
  """Keeps what C++ libraries print to stderr while they load off the console.

  TensorFlow's C++ logging writes before anything can configure it (CUDA
  probes, `cuInit` errors on machines without a GPU for it, CPU feature
  notes), whatever TF_CPP_MIN_LOG_LEVEL says. Only file descriptor 2 can
  catch it. What was caught is printed after all if loading fails, and
  always with --verbosity.
  """
  if _LIBRARY_LOGS:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    except KeyboardInterrupt:  # the user's Ctrl-C, not a failed load: nothing to show
      raise
    except BaseException:
      os.dup2(saved, 2)
      caught.seek(0)
      sys.stderr.write(caught.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def _allow_user_modules_from_cwd() -> None:
  # A console script's sys.path does not include the working directory, yet
  # that is where users keep the module named by MIXTURE_OR_TASK_MODULE.
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())


def _configure_data_dirs() -> None:
  import seqio
  if FLAGS.tfds_data_dir:
    seqio.set_tfds_data_dir_override(FLAGS.tfds_data_dir)
  if FLAGS.seqio_additional_cache_dirs:
    seqio.add_global_cache_dirs(FLAGS.seqio_additional_cache_dirs)


def _distributed_config():
  from t5lite import distributed
  return distributed.DistributedConfig(
      multiprocess_gpu=FLAGS.multiprocess_gpu, coordinator_address=FLAGS.coordinator_address,
      process_count=FLAGS.process_count, process_index=FLAGS.process_index,
      initialization_timeout=FLAGS.initialization_timeout,
      heartbeat_timeout=FLAGS.heartbeat_timeout)


# Platforms JAX_PLATFORMS may name: JAX's own and those of the PJRT plugins
# JAX knows by name (plugins register their backend only when JAX starts).
_JAX_PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu", "METAL", "oneapi", "neuron")


def check_jax_platforms(value: str | None) -> None:
  """JAX_PLATFORMS must name only platforms JAX knows, else JAX fails deep
  inside its first device query, after start-up work, with a traceback.

  Raises:
    ValueError: an unknown platform name, with the known ones.
  """
  known = set(_JAX_PLATFORMS)
  from t5lite import jax_internals
  try:
    known |= jax_internals.registered_platforms()
  except (ImportError, AttributeError):  # moved in a JAX release: the fixed list
    pass
  names = [n.strip() for n in (value or "").split(",") if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise UserError(f"JAX_PLATFORMS={value!r} names unknown platform(s) {', '.join(unknown)}; "
                    f"use a comma-separated list of {', '.join(sorted(known, key=str.lower))}, "
                    "or unset it to let JAX choose.")


# JAX's words when a platform named in JAX_PLATFORMS does not start, and the
# advice it appends.
_BACKEND_FAILED = re.compile(r"Unable to initialize backend '([^']+)': (.*?)"
                             r"(?: \(set JAX_PLATFORMS=.*\))?", re.DOTALL)


def check_jax_platforms_present(value: str | None) -> None:
  """Starts the platforms JAX_PLATFORMS names, which must be on this machine;
  else JAX fails at its first device query with a traceback (a RuntimeError,
  or an AssertionError when it skipped every platform named).

  Call it after `jax.distributed.initialize`, which must come before any
  backend starts.

  Raises:
    ValueError: a platform this machine does not have, naming the ones it has.
  """
  if not value or not value.strip():
    return
  import jax

  from t5lite import jax_internals
  reasons = [jax_internals.passed_over(p) for p in jax_internals.expand_platforms(value)]
  skipped = [r for r in reasons if r is not None]
  if len(skipped) == len(reasons):
    raise UserError(_platform_missing_message(value, skipped))
  try:
    jax.devices()
  except RuntimeError as error:
    match = _BACKEND_FAILED.fullmatch(str(error).strip())
    if match is None:
      raise
    failed = " ".join(match.group(2).split()).rstrip(".")
    raise UserError(_platform_missing_message(
        value, [*skipped, f"JAX could not start '{match.group(1)}': {failed}"])) from None


def _platform_missing_message(value: str, reasons: Sequence[str]) -> str:
  from t5lite import jax_internals
  has = ", ".join(jax_internals.platforms_present())
  return (f"JAX_PLATFORMS={value!r} names a platform this machine does not have: "
          f"{'; '.join(reasons)}. This machine has: {has}; set JAX_PLATFORMS="
          f"{has.split(', ')[0]}, or unset it to let JAX choose.")


def start(entry: Callable[[], Callable[..., object]]) -> Callable[..., object]:
  """What every command does before its work, from the parsed flags: checks
  of the flags and the platform, the compilation cache, the multi-process
  job, gin. Returns the configured run; raises `UserError` for bad input.

  The console scripts call it through `_run`; tests call it in-process to
  check what a command says about bad input without a process of its own.
  """
  from t5lite import compilation_cache, distributed
  if FLAGS.dry_run and entry is not _train_entry:
    raise UserError("--dry_run is a t5lite-train flag; this command has no dry run. Drop "
                    "the flag, or check the training config with t5lite-train --dry_run.")
  if FLAGS.overwrite and entry is not _export_entry:
    raise UserError("--overwrite is a t5lite-export flag (it lets an export replace "
                    "EXPORT_DIR); this command has no use for it. Drop the flag.")
  check_jax_platforms(os.environ.get("JAX_PLATFORMS"))
  # A dry run compiles nothing, so it leaves the cache directory alone too.
  compilation_cache.configure(FLAGS.compilation_cache_dir,
                              FLAGS.compilation_cache and not FLAGS.dry_run)
  distributed.validate(_distributed_config())
  _hide_gpus_from_tensorflow()
  distributed.initialize(_distributed_config())
  check_jax_platforms_present(os.environ.get("JAX_PLATFORMS"))
  _configure_data_dirs()
  _allow_user_modules_from_cwd()
  parse_gin(FLAGS.gin_file, FLAGS.gin_bindings, gin_search_paths(FLAGS.gin_search_paths))
  if FLAGS.mesh_selector:
    select_mesh(FLAGS.mesh_selector)
  return entry()


def _run(entry: Callable[[], Callable[..., object]]) -> None:
  """Start-up, then the gin-configured entry point with user errors as one line."""
  from t5lite import distributed
  try:
    run = start(entry)
    gc.freeze()  # modules and config live until exit: later collections skip them
    run()
  except UserError as error:  # raised on purpose where t5lite checks the input
    _stop(USER_ERROR_EXIT, console.one_line(error))
  except _training_stopped() as stop:
    _stop(stop.exit_code, console.one_line(stop))
  except write_errors.WriteError as error:  # a failed write under MODEL_DIR, not the input
    _stop(IO_ERROR_EXIT, console.one_line(error))
  except Exception as error:
    traceback.print_exc()
    distributed.blame_lost_peer(error)
    _stop(1, f"Unexpected error, a bug in t5lite or a library (the traceback above shows "
          f"where): {console.one_line(error)}")
  distributed.finish()


def _stop(exit_code: int, line: str) -> None:
  """Prints the one-line reason and exits; in a multi-process job the peers
  are told before the exit, so they stop too instead of waiting in a
  collective."""
  _say_last(f"t5lite: {line}")
  # Not imported here: a Ctrl-C during the imports must not import JAX to
  # report itself, and a job is joined only through this module, so without
  # it (not imported, or interrupted while being imported) no peer waits.
  report_failure = getattr(sys.modules.get("t5lite.distributed"), "report_failure", None)
  if report_failure is not None:
    report_failure(exit_code, line)
  os._exit(exit_code)


def _say_last(line: str) -> None:
  """Writes `line` to stderr as the last thing this process prints there.

  By the time a run stops with a reason, its writers are flushed and closed
  and the checkpoint in flight has finished or failed; what is left is
  shutting down. An ordinary interpreter shutdown would only add noise or
  hang: Python joins every non-daemon thread (after a failed checkpoint
  write, Orbax's commit threads wait for signals that never come), and the
  finalizers of library objects still alive print tracebacks (an asyncio
  loop already closed) when a collection or the shutdown reaches them, in
  this thread or any other. So no collection runs from here on, pending
  output is flushed, and stderr is pointed at /dev/null before the line is
  written to the real one; the caller then ends the process with `os._exit`.
  """
  import logging as std_logging
  gc.disable()
  std_logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  real_stderr = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.write(real_stderr, f"{line}\n".encode())


def _training_stopped() -> type[Exception]:
  from t5lite.stops import TrainingStopped
  return TrainingStopped


def _train_entry() -> Callable[..., object]:
  import functools

  import gin
  from t5lite import train as train_lib
  if FLAGS.dry_run:
    from t5lite import dry_run
    # get_bindings evaluates the references, so these are the very arguments
    # the configured train() would receive.
    return lambda: dry_run.run(**gin.get_bindings(train_lib.train))
  configured = gin.get_configurable(train_lib.train)
  return functools.partial(configured, summarize_config_fn=write_operative_config)


# Libraries whose warnings are about their own workings, not the user's run:
# SeqIO's and Orbax's on every normal run (unused pretokenized features,
# generous eval lengths, read-only checkpoint managers), TensorFlow's
# (AutoGraph leaving a map function of SeqIO's as written, which it asks to
# be reported to the TensorFlow team), JAX's and Flax's. Errors from them
# still show; --verbosity shows everything.
_NOISY_PACKAGES = ("seqio", "orbax", "tensorflow", "jax", "jaxlib", "flax", "clu")
_NOISY_LIBRARIES = tuple(f"{os.sep}{package}{os.sep}" for package in _NOISY_PACKAGES)
# Errors a library logs from a background thread and then raises again to
# its caller, where t5lite reports them: a failed write once, as the run's
# last line (exit 5); anything else with its traceback. Shown as well, one
# failure would be told once per thread (Orbax's array, sharding and
# metadata writers, its commit and finalize threads, clu's summary writer,
# SeqIO's metrics of each task), each of which logs what it then raises.
# (file, words of the message format) as Orbax 0.12, clu 0.0.12 and SeqIO log them;
# a record that no longer matches after an upgrade shows, it is never lost.
_RERAISED_LIBRARY_ERRORS = (
    (f"{os.sep}orbax{os.sep}checkpoint{os.sep}_src{os.sep}futures{os.sep}future.py",
     "_SignalingThread.run() raised an exception"),
    (f"{os.sep}orbax{os.sep}checkpoint{os.sep}_src{os.sep}checkpointers{os.sep}"
     "async_checkpointer.py", "Handler Commit operations or the Commit callback"),
    (f"{os.sep}orbax{os.sep}checkpoint{os.sep}checkpoint_manager.py",
     "[wait_until_finished] Save Finalize thread (%s) failed."),
    (f"{os.sep}orbax{os.sep}checkpoint{os.sep}_src{os.sep}metadata{os.sep}checkpoint.py",
     "Failed to write metadata=%s path=%s"),
    (f"{os.sep}orbax{os.sep}checkpoint{os.sep}_src{os.sep}metadata{os.sep}checkpoint.py",
     "Failed to update metadata=%s path=%s"),
    (f"{os.sep}clu{os.sep}asynclib.py", "Error in producer thread for %s"),
    (f"{os.sep}seqio{os.sep}evaluation.py", "Failed to evaluate task %s: %s"),
)


def _drop_library_warnings(record) -> bool:
  import logging as std_logging
  if any(record.pathname.endswith(path) and words in str(record.msg)
         for path, words in _RERAISED_LIBRARY_ERRORS):
    return False
  if not any(part in record.pathname for part in _NOISY_LIBRARIES):
    return True
  if record.levelno < std_logging.ERROR:
    return False
  # Other errors of theirs keep their first line and lose the traceback.
  record.exc_info, record.exc_text, record.stack_info = None, None, None
  return True


def _drop_abandoned_loop_reports(hook: Callable[..., None]) -> Callable[..., None]:
  """`sys.unraisablehook` without TensorStore's reports of results that
  arrive for an asyncio loop Orbax has closed.

  Orbax writes (and reads) a checkpoint's arrays with TensorStore futures
  awaited on a fresh event loop per operation. When one write fails, the
  operation raises at once and Orbax closes that loop while the other
  writes are still running; as each of them ends, TensorStore hands its
  result to the closed loop (`loop.call_soon_threadsafe`), which raises
  `RuntimeError('Event loop is closed')` in TensorStore's thread, and
  TensorStore reports it as unraisable: one traceback per array, tens to
  thousands of lines. Nothing awaits those results; the failure that ended
  the operation is the one reported. Every other unraisable error goes to
  `hook`.
  """
  def unraisable(report) -> None:
    frames = traceback.extract_tb(report.exc_traceback) if report.exc_traceback else []
    if (report.object is None and isinstance(report.exc_value, RuntimeError)
        and str(report.exc_value) == "Event loop is closed"
        and [f.name for f in frames[-2:]] == ["call_soon_threadsafe", "_check_closed"]):
      return
    hook(report)
  return unraisable


def verbosity_given(argv: Sequence[str]) -> bool:
  """Whether the command line sets absl's --verbosity, in any of the
  spellings absl accepts (--verbosity=1, --v=0, -v 1, ...)."""
  for arg in argv[1:]:
    if arg == "--":
      break
    if arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] in ("verbosity", "v"):
      return True
  return False


def _quiet_libraries(argv: Sequence[str]) -> None:
  # Orbax and TensorFlow log every file they touch at INFO; the progress lines
  # are what a person reads. An explicit --verbosity brings the library logs
  # back, and the native start-up output of TensorFlow and XLA with them.
  global _LIBRARY_LOGS
  _LIBRARY_LOGS = verbosity_given(argv)
  if not _LIBRARY_LOGS:
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_handler().addFilter(_drop_library_warnings)
    sys.unraisablehook = _drop_abandoned_loop_reports(sys.unraisablehook)
    # Python warnings raised inside those libraries (a deprecation in one
    # library of another's API); one they attribute to t5lite still shows.
    warnings.filterwarnings("ignore", module=rf"({'|'.join(_NOISY_PACKAGES)})(\.|$)")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# Python's cyclic garbage collector, left at its default thresholds, spends a
# tenth of a short run's CPU time walking the objects of the libraries being
# imported and of the model being traced: objects that live as long as the
# process. A larger youngest generation (collected every 10,000 net
# allocations instead of 700) and freezing what start-up built before the
# entry point runs cut it from 2.3 s to 0.6 s (docs/performance.md, Start-up).
_GC_YOUNGEST_THRESHOLD = 10_000


def collect_garbage_less_during_start_up() -> None:
  """The larger youngest generation; also used by t5lite's test processes."""
  gc.set_threshold(_GC_YOUNGEST_THRESHOLD, *gc.get_threshold()[1:])


def _main(entry: Callable[[], Callable[..., object]]) -> None:
  with console.ctrl_c_as_one_line(_interrupted):
    collect_garbage_less_during_start_up()
    argv = rewrite_gin_args(sys.argv)

    def main(unused_argv: Sequence[str]) -> None:
      _quiet_libraries(argv)
      if len(unused_argv) > 1:
        print(f"t5lite: unexpected arguments {unused_argv[1:]}; flags look like "
              "--gin_file=... or --gin.NAME=VALUE.", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
      _run(entry)

    console.run(main, argv, "t5lite")


def _interrupted() -> None:
  """A Ctrl-C before the training loop took SIGINT over (imports, gin,
  tracing, compiling, restoring), after it ended, or while t5lite-eval,
  -infer or -export work: no checkpoint is being written then, so the
  process ends at once. The files written before are whole (config.gin and
  model-info.txt go through a temporary file), and the run lock was
  released on the way out."""
  _stop(console.INTERRUPTED_EXIT, "Interrupted: Stopped by Ctrl-C; no checkpoint was being "
        "written. Rerun the same command to start again.")


def train_main() -> None:
  """`t5lite-train`."""
  _main(_train_entry)


def _eval_entry() -> Callable[..., object]:
  import gin
  from t5lite import evaluate
  return gin.get_configurable(evaluate.evaluate)


def _infer_entry() -> Callable[..., object]:
  import gin
  from t5lite import evaluate
  return gin.get_configurable(evaluate.infer)


def eval_main() -> None:
  """`t5lite-eval`."""
  _main(_eval_entry)


def infer_main() -> None:
  """`t5lite-infer`."""
  _main(_infer_entry)


def _export_entry() -> Callable[..., object]:
  import functools

  import gin
  from t5lite import evaluate
  configured = gin.get_configurable(evaluate.export_huggingface)
  # Without the flag, a gin binding of `overwrite` still applies.
  return functools.partial(configured, overwrite=True) if FLAGS.overwrite else configured


def export_main() -> None:
  """`t5lite-export`."""
  _main(_export_entry)


# What each console script runs, by its name (`start` takes these).
ENTRIES = {"t5lite-train": _train_entry, "t5lite-eval": _eval_entry,
           "t5lite-infer": _infer_entry, "t5lite-export": _export_entry}


if __name__ == "__main__":
  train_main()
