"""Every command in README.md and docs/*.md runs, in a CI-sized form.

Each document runs in its own sandbox: a directory whose entries link to the
checkout's top level (so `gin/`, `.venv/`, `Makefile`, `t5lite/` resolve as
in the repository root) and where everything the commands write lands.
Fenced ```sh blocks run in order, each as one bash script with `set -e`;
a ```python file=NAME (or ```gin file=NAME) block is written to NAME first.
In a page a reader follows in a notebook (NOTEBOOKS), the ```python blocks
run too: together, in order, as one script in one process, after the
page's commands. A command is
rewritten to CI size by the rule for its program in RULES; a program with
no rule fails the test, so a new document or command is never silently
skipped; a benchmark command whose CI-sized form equals an earlier one of
the same page runs once, and a command another test runs in the same form
(RUN_ELSEWHERE_LINES) runs there only. Commands that need a cluster or
GPUs are listed in CLUSTER_ONLY with the reason; where their config can
still be checked, they run as `--dry_run` on fake CPU devices instead.

The gin reference is checked against the shipped gin files and the
signatures it documents, so it cannot fall behind them.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import inspect
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable

import benchmark_checks
import pytest
from test_cli import SHALLOW


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO)
                             for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
OVERLAY = "--gin_file=gin/testing/local_tiny.gin"
# CI-sized runs: the overlay trains 4 steps; a run told to go further trains
# 2 more. Evaluation happens once, at step 4, and fine-tuning runs decode
# their whole validation split in large batches.
CI_TRAIN_STEPS = 6
CI_RELATIVE_STEPS = 2
CI_EVAL_PERIOD = 4
CI_BINDINGS = (f"--gin.EVAL_PERIOD={CI_EVAL_PERIOD}",
               "--gin.infer_eval/datasets.DatasetConfig.batch_size=200")
CI_EVAL_EXAMPLES = 8
# With the overlay, one layer per stack (test_cli's SHALLOW), and in a
# Mixture-of-Experts model that layer is its MoE layer: what the commands
# check (that they run, what they print and write) does not depend on depth,
# and a docs-sized fine-tuning run takes about a fifth less CPU.
CI_SHALLOW = (*SHALLOW, "--gin.MOE_LAYER_INTERVAL=1")
TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class ClusterOnly:
  """A block that needs a cluster or GPUs: why, and how its config is checked."""

  marker: str            # text that identifies the block
  reason: str
  fake_devices: int | None  # run its t5lite commands as --dry_run on this many CPUs


# Every block that cannot run on one CPU machine, by document. The marker must
# still be found, so a rewritten document cannot leave a stale entry behind.
CLUSTER_ONLY = {
    "docs/multi_host.md": [
        ClusterOnly("#SBATCH --ntasks-per-node=8", "SLURM job: 4 nodes x 8 GPUs, one process "
                    "per GPU, NCCL", 32),
        ClusterOnly("#SBATCH --ntasks-per-node=1", "SLURM job: 4 nodes x 8 GPUs, one process "
                    "per node, NCCL", 32),
        ClusterOnly("# on node001 (process 0)", "two hosts named node001 and node002", 1),
    ],
    "docs/moe.md": [
        ClusterOnly("--gin.NUM_EXPERT_PARTITIONS=16", "64 experts over 16-way expert "
                    "parallelism on a multi-host GPU job (--multiprocess_gpu)", 16),
    ],
    "docs/performance.md": [
        ClusterOnly("benchmarks/gpu.sh", "needs one NVIDIA GPU with CUDA 12 (the script "
                    "installs jax's CUDA plugin)", None),
    ],
    "docs/data.md": [
        ClusterOnly("--tfds_data_dir=/data/tfds", "needs the C4 TFDS dataset prepared on "
                    "disk (a large download); t5lite itself never downloads", None),
    ],
}
# Flags that start or join a multi-process job; a dry run drops them.
_MULTIPROCESS_FLAGS = ("--multiprocess_gpu", "--coordinator_address", "--process_count",
                       "--process_index")


@dataclasses.dataclass(frozen=True)
class Block:
  doc: str
  line: int
  info: str
  text: str


def fenced_blocks(doc: str, checkout: str = REPO) -> list[Block]:
  """The fenced code blocks of a Markdown file, with their info strings."""
  path = os.path.join(checkout, doc)
  blocks, lines = [], open(path, encoding="utf-8").read().splitlines()
  i = 0
  while i < len(lines):
    match = re.match(r"^(\s*)```(.*)$", lines[i])
    if not match:
      i += 1
      continue
    start, body = i, []
    i += 1
    while i < len(lines) and not lines[i].strip().startswith("```"):
      body.append(lines[i][len(match.group(1)):])
      i += 1
    blocks.append(Block(doc, start + 1, match.group(2).strip(), "\n".join(body) + "\n"))
    i += 1
  return blocks


def logical_lines(text: str) -> list[str]:
  """Lines with backslash continuations joined; comments and blank lines dropped."""
  joined = re.sub(r"\\\n\s*", " ", text)
  return [line.strip() for line in joined.splitlines()
          if line.strip() and not line.strip().startswith("#")]


def _quote(token: str) -> str:
  if re.fullmatch(r"[\w@%+=:,./-]+", token):
    return token
  if not re.search(r"[\"`\\!]", token):
    return f'"{token}"'  # reads like the docs, and keeps $i expanding
  return shlex.quote(token)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Rewriting a command to CI size


class Sandbox:
  """The directory a document's commands run in: a checkout, or a directory
  whose entries link to one (so outputs stay out of the checkout)."""

  def __init__(self, root, port: int = 0, link_to: str | None = REPO):
    self.root = str(root)
    self.port = port  # for a documented localhost coordinator
    for name in os.listdir(link_to) if link_to else []:
      if name not in (".git", "runs", "__pycache__", ".pytest_cache"):
        os.symlink(os.path.join(link_to, name), os.path.join(self.root, name))

  def absolute(self, token: str) -> str:
    """Absolute paths in flag values move into the sandbox."""
    return re.sub(r"(^|=|')/(?!/)", lambda m: f"{m.group(1)}{self.root}/abs/", token)

  def newest_step(self, token: str) -> str:
    """A step directory the CI-sized run never reached becomes its newest step."""
    def replace(m):
      checkpoints = os.path.join(self.root, m.group(1))
      if os.path.isdir(os.path.join(checkpoints, m.group(2))) or not os.path.isdir(checkpoints):
        return m.group(0)
      steps = sorted(int(s) for s in os.listdir(checkpoints) if s.isdigit())
      return f"{m.group(1)}/{steps[-1]}" if steps else m.group(0)
    return re.sub(r"([\w./-]*checkpoints)/(\d+)", replace, token)


def _split(line: str) -> tuple[list[str], list[str], bool]:
  """(VAR=value prefixes, the command's tokens, runs in the background)."""
  tokens = shlex.split(line)
  background = bool(tokens) and tokens[-1] == "&"
  tokens = tokens[:-1] if background else tokens
  env = []
  while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
    env.append(tokens.pop(0))
  return env, tokens, background


def _join(env: list[str], tokens: list[str], background: bool) -> str:
  return " ".join(_quote(t) for t in [*env, *tokens]) + (" &" if background else "")


def _shrink_t5lite(tokens: list[str], box: Sandbox) -> list[str]:
  """t5lite-train/-eval/-infer: tiny overlay, few steps, few examples, paths in the sandbox."""
  program = os.path.basename(tokens[0])
  out = []
  for token in tokens:
    token = box.newest_step(box.absolute(token))
    token = re.sub(r"^(--gin\.TRAIN_STEPS=)(\d+)$",
                   lambda m: m.group(1) + str(min(int(m.group(2)), CI_TRAIN_STEPS)), token)
    token = re.sub(r"^(--gin\.train_lib\.train\.relative_steps=)(\d+)$",
                   lambda m: m.group(1) + str(min(int(m.group(2)), CI_RELATIVE_STEPS)), token)
    token = re.sub(r"^(--coordinator_address=localhost:)\d+$",
                   lambda m: m.group(1) + str(box.port), token)
    out.append(token)
  if "--dry_run" in out:
    return out  # checks the documented config itself; nothing runs
  # An imported checkpoint fixes the model's sizes, so the tiny overlay
  # cannot shrink it; the documented commands use the small committed ones.
  imported = program == "t5lite-export" or any(_imported_model(t, box) for t in out)
  out += [] if OVERLAY in out or imported else [OVERLAY]
  out += list(CI_SHALLOW) if OVERLAY in out else []
  out += list(CI_BINDINGS) if program == "t5lite-train" else []
  if program == "t5lite-train" and imported:
    # An imported T5X run's file carries that run's checkpoint period, which
    # CI's evaluation period must divide.
    out.append(f"--gin.CHECKPOINT_PERIOD={CI_EVAL_PERIOD}")
  if program == "t5lite-eval":
    out.append(f"--gin.NUM_EVAL_EXAMPLES={CI_EVAL_EXAMPLES}")
  if program == "t5lite-infer":
    out.append(f"--gin.NUM_EXAMPLES={CI_EVAL_EXAMPLES}")
  return out


def _imported_model(token: str, box: Sandbox) -> bool:
  """Whether a flag names a gin file `t5lite-import` wrote: outside gin/ and
  fixing the model's sizes (a task file a document writes does not)."""
  if not token.startswith("--gin_file=") or token.split("=", 1)[1].startswith("gin/"):
    return False
  path = os.path.join(box.root, token.split("=", 1)[1])
  return not os.path.isfile(path) or "TransformerConfig" in open(path, encoding="utf-8").read()


def _make(tokens: list[str], box: Sandbox) -> list[str]:
  """`make train` runs the command make would run, CI-sized; other targets
  must at least resolve (`make -n`)."""
  if tokens[1:] != ["train"]:
    return ["make", "--no-print-directory", "-n", *tokens[1:]]
  printed = subprocess.run(["make", "--no-print-directory", "-n", "train"], cwd=box.root,
                           capture_output=True, text=True, check=True,
                           timeout=120).stdout.strip().splitlines()
  command = shlex.split(printed[-1])
  assert os.path.basename(command[0]) == "t5lite-train", printed
  return _shrink_t5lite(command, box)


def _tensorboard(tokens: list[str], box: Sandbox) -> list[str]:
  # --inspect reads the event files and exits instead of serving them.
  return [tokens[0], "--inspect", *[box.absolute(t) for t in tokens[1:]]]


def _as_is(tokens: list[str], box: Sandbox) -> list[str]:
  return tokens


# The benchmark scripts at smoke-test size: their code paths, not their figures.
# The compile sweep at one depth still compiles both layouts in a fresh
# process; features.py measures one variant, with two gin switches (each
# variant is the same code with other bindings, and every switch is compiled
# and checked by the model tests), and its prefetch comparison at 2 steps
# still has a stats period to compare (its loop is run.py's, measured above it).
BENCH_TINY_GIN = "--gin_file=gin/testing/bench_tiny.gin"
# memory.py compares remat in a scanned stack with the plain scan: two layers.
BENCH_MEMORY_GIN = "--gin_file=gin/testing/bench_tiny_two_layers.gin"
BENCH_TINY_ARGS = {
    "run.py": ["--steps=6", "--stats=2", "--bare_steps=2", "--pipeline_batches=4",
               "--compile_depths=1", "--memory_steps=2", "--matmul_sizes=64"],
    "features.py": ["--steps=1", "--blocks=1", "--train_steps=2",
                    "--variant=scan_layers + remat full"],
    "profile_step.py": ["--steps=1", "--top=5"],
    "checkpoint_blocking.py": ["--steps=6", "--checkpoint_period=2", "--stats=2"],
    "bucket_checkpoints.py": ["--steps=4", "--checkpoint_period=2"],
    "decode.py": ["--batch=2", "--length=8", "--repeats=1"],
    # The model of the tiny gin file _benchmark adds (1 + 1 layers, width 8).
    "import_throughput.py": ["--repeats=1"],
    # Against the committed HEAD: a CI checkout may hold no older commit.
    "compare_commits.py": ["--base=HEAD", "--runs=1", "--steps=4", "--stats=2"],
    "startup.py": ["--runs=1"],
    "memory.py": [],
}
_WRITES_JSON = ("run.py", "features.py", "checkpoint_blocking.py", "bucket_checkpoints.py",
                "decode.py",
                "import_throughput.py", "compare_commits.py", "startup.py", "memory.py")


def _benchmark(tokens: list[str], box: Sandbox) -> list[str]:
  """`python benchmarks/X.py`: the script on a tiny config, its JSON in the sandbox."""
  script = os.path.basename(tokens[1]) if len(tokens) > 1 else ""
  assert tokens[1:2] and tokens[1].startswith("benchmarks/") and script in BENCH_TINY_ARGS, (
      f"no CI-sized form for `{' '.join(tokens)}`: add the script to BENCH_TINY_ARGS")
  tiny = BENCH_TINY_ARGS[script]
  overridden = tuple(a.split("=")[0] + "=" for a in tiny) + ("--output=",)
  out = [t for t in tokens if not t.startswith(overridden)]
  if script in ("checkpoint_blocking.py", "bucket_checkpoints.py"):
    out += ([] if any(t.startswith("--gin_file=") for t in out)
            else ["--gin_file=gin/pretrain_dense.gin"]) + [OVERLAY]
  elif script == "compare_commits.py":  # each --gin_file is one more config to compare
    out = [t for t in out if not t.startswith("--gin_file=")] + [BENCH_TINY_GIN]
  elif script != "decode.py":  # decode.py takes a model file, already tiny
    gin_file = BENCH_MEMORY_GIN if script == "memory.py" else BENCH_TINY_GIN
    out = [gin_file if t.startswith("--gin_file=gin/benchmarks/") else t for t in out]
    out += [] if gin_file in out else [gin_file]
  out += tiny
  if script in _WRITES_JSON:
    out.append(f"--output={box.root}/bench-results/{script[:-3]}.json")
  return out


# Programs the docs may use, and how each becomes a CI-sized command.
RULES = {
    "t5lite-train": _shrink_t5lite,
    "t5lite-eval": _shrink_t5lite,
    "t5lite-infer": _shrink_t5lite,
    "t5lite-vocab": _as_is,
    "t5lite-import": _as_is,
    "t5lite-export": _shrink_t5lite,
    "tensorboard": _tensorboard,
    "make": _make,
    "python": _benchmark,
    "mkdir": _as_is, "gunzip": _as_is, "printf": _as_is, "cp": _as_is, "cat": _as_is,
    "ls": _as_is, "echo": _as_is,
}
# Shell syntax passed through unchanged; `wait` is replaced so that a failed
# background job fails the block (a bare `wait` always succeeds).
SHELL_LINES = ("export ", "for ", "done", "do ")
WAIT_ALL = 'for job in $(jobs -p); do wait "$job"; done'


def ci_line(line: str, box: Sandbox, where: str) -> str:
  if line == "wait":
    return WAIT_ALL
  if line.startswith(SHELL_LINES):
    return line
  env, tokens, background = _split(line)
  rule = RULES.get(os.path.basename(tokens[0]))
  if rule is None:
    raise AssertionError(
        f"{where}: no CI-sized form for `{line}`; add its program to RULES in "
        "tests/test_docs.py, or the block to CLUSTER_ONLY with the reason it cannot run here.")
  if rule is _as_is:
    return line  # redirections and all
  return _join(env, rule(tokens, box), background)


def fragment_script(block: Block, box: Sandbox) -> str:
  """A block of flags only (to add to a command): a dry run of a fine-tune
  with them parses and validates them."""
  tokens = shlex.split(" ".join(logical_lines(block.text)))
  command = [".venv/bin/t5lite-train", "--gin_file=gin/finetune_dense.gin",
             "--gin.MODEL_DIR='runs/fragment'", *tokens, "--dry_run"]
  return _join([], command, False)


def cluster_script(block: Block, entry: ClusterOnly, box: Sandbox) -> str:
  """The t5lite commands of a cluster-only block as dry runs on fake devices."""
  if entry.fake_devices is None:
    return ""
  lines = []
  for line in logical_lines(block.text):
    _, tokens, _ = _split(line)
    starts = [i for i, t in enumerate(tokens) if os.path.basename(t).startswith("t5lite-")]
    if not starts:
      continue  # exports, srun options: the scheduler's part
    command = [t for t in tokens[starts[0]:]
               if not t.startswith(_MULTIPROCESS_FLAGS)]
    command = [box.absolute(t) for t in command] + ["--dry_run"]
    env = ["JAX_PLATFORMS=cpu",
           f"XLA_FLAGS=--xla_force_host_platform_device_count={entry.fake_devices}"]
    lines.append(_join(env, command, False))
  assert lines, f"{block.doc}:{block.line}: cluster block without a t5lite command"
  return "\n".join(lines)


def block_scripts(block: Block, box: Sandbox) -> list[Callable[[], str]]:
  """The bash scripts a block runs as, in order; none for blocks that are not
  commands. Each is built just before it runs, so that a command can name
  what an earlier one wrote (a checkpoint step, say)."""
  where = f"{block.doc}:{block.line}"
  for entry in CLUSTER_ONLY.get(block.doc, []):
    if entry.marker in block.text:
      script = cluster_script(block, entry, box)
      return [lambda script=script: script] if script else []
  if block.info.split()[:1] != ["sh"]:
    return []
  lines = logical_lines(block.text)
  if lines and lines[0].startswith("--"):
    script = fragment_script(block, box)
    return [lambda: script]
  for line in lines:
    ci_line(line, box, where)  # fails now for a command without a rule
  if any(line == "wait" or line.startswith(SHELL_LINES) for line in lines):
    return [lambda: "\n".join(ci_line(line, box, where) for line in lines)]
  return [lambda line=line: ci_line(line, box, where) for line in lines
          if (block.doc, line) not in RUN_ELSEWHERE_LINES]


# Single commands of a document that another test runs in the same CI-sized
# form (its ci_line), and which one.
RUN_ELSEWHERE_LINES = {
    ("README.md", "make train"): "tests/test_newcomer.py, in a fresh clone",
}


# Pages whose ```python blocks a reader runs in order (a notebook page, the
# README's first steps): they run as one script (see the module docstring).
NOTEBOOKS = ("README.md", "docs/python_api.md")
NOTEBOOK_SCRIPT = "notebook.py"


def notebook_script(doc: str, box: Sandbox) -> str | None:
  """A notebook page's ```python blocks as one script in `box`, run by the
  checkout's Python; None for other pages."""
  if doc not in NOTEBOOKS:
    return None
  cells = [b for b in fenced_blocks(doc, box.root) if b.info == "python"]
  assert cells, f"{doc}: a notebook page without ```python blocks"
  with open(os.path.join(box.root, NOTEBOOK_SCRIPT), "w", encoding="utf-8") as f:
    f.write("\n".join(f"# {doc}:{cell.line}\n{cell.text}" for cell in cells))
  return f".venv/bin/python {NOTEBOOK_SCRIPT}"


def _is_benchmark(script: str) -> bool:
  """Whether a script is one benchmark command, CI-sized. It depends on
  nothing an earlier command left, so a second one equal to it (the
  documented commands differed in what CI size replaces: a base commit,
  configs, step counts) checks nothing more and runs once."""
  if "\n" in script:
    return False
  _, tokens, background = _split(script)
  return not background and RULES.get(os.path.basename(tokens[0])) is _benchmark


def run_document(doc: str, box: Sandbox, **env_vars: str) -> list[str]:
  """Runs a document's blocks in order in `box`; returns a line per command."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             PATH=os.pathsep.join([os.path.join(box.root, ".venv", "bin"),
                                   os.environ.get("PATH", "")]), **env_vars)
  log, benchmarks_run = [], {}
  for block in fenced_blocks(doc, box.root):
    file_name = re.fullmatch(r"(?:python|gin)\s+file=(\S+)", block.info)
    if file_name:
      with open(os.path.join(box.root, file_name.group(1)), "w", encoding="utf-8") as f:
        f.write(block.text)
      continue
    for build in block_scripts(block, box):
      script, where = build(), f"{doc}:{block.line}"
      if script in benchmarks_run:
        log.append(f"{where}: as {benchmarks_run[script]}, not run again")
        continue
      log.append(_run_script(script, where, box, env))
      if _is_benchmark(script):
        benchmarks_run[script] = where
  notebook = notebook_script(doc, box)
  if notebook is not None:
    log.append(_run_script(notebook, f"{doc} (its python blocks)", box, env))
  return log


def _run_script(script: str, where: str, box: Sandbox, env: dict[str, str]) -> str:
  """Runs one bash script in `box`, which must succeed; returns its log line."""
  started = time.monotonic()
  result = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=box.root,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
  assert result.returncode == 0, (
      f"{where} failed ({result.returncode}):\n{script}\n--- stdout\n"
      f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
  if "--inspect" in script:
    assert "Event statistics for" in result.stdout, f"{where}: no events\n{result.stdout}"
  return f"{where}: {time.monotonic() - started:.0f}s {script[:100]}"


def test_every_cluster_entry_still_matches_a_block():
  for doc, entries in CLUSTER_ONLY.items():
    text = "".join(b.text for b in fenced_blocks(doc))
    for entry in entries:
      assert entry.marker in text, f"{doc}: no block contains {entry.marker!r}; update " \
                                   "CLUSTER_ONLY"


def test_every_command_run_elsewhere_is_still_in_its_document():
  for (doc, line), elsewhere in RUN_ELSEWHERE_LINES.items():
    commands = [c for b in fenced_blocks(doc) if b.info == "sh" for c in logical_lines(b.text)]
    assert line in commands, f"{doc} no longer has `{line}` ({elsewhere}); update " \
                             "RUN_ELSEWHERE_LINES"


def test_every_command_has_a_ci_form(tmp_path):
  """Cheap check that every command is known, before the slow runs."""
  box = Sandbox(tmp_path)
  for doc in DOCS:
    for block in fenced_blocks(doc):
      block_scripts(block, box)  # raises for a command without a rule


# Documents whose commands another test runs in full, and which one.
RUN_ELSEWHERE = {
    "docs/quickstart.md": "tests/test_newcomer.py runs it, in order, in a fresh clone",
}


# The order `make docs-check` starts the documents in, so that its two
# workers end together. pytest-xdist hands each worker two tests to begin
# with: the first gets the newcomer path (first, see conftest.py) and the
# cheapest document, the second the longest document (performance.md) and
# one of middle size; whichever worker frees first takes the rest, longest
# first. A document missing here runs last.
DOCS_ORDER = ["docs/gin_reference.md", "docs/performance.md", "docs/multi_host.md", "README.md",
              "docs/checkpoints.md", "docs/evaluation.md", "docs/data.md",
              "docs/python_api.md", "docs/moe.md", "docs/partitioning.md"]


def _in_docs_order(docs: list[str]) -> list[str]:
  return sorted(docs, key=lambda d: DOCS_ORDER.index(d) if d in DOCS_ORDER else len(DOCS_ORDER))


@pytest.mark.slow
@pytest.mark.docs
@pytest.mark.parametrize("doc", _in_docs_order([d for d in DOCS if d not in RUN_ELSEWHERE]))
def test_document_commands_run(doc, tmp_path):
  box = Sandbox(tmp_path, port=free_port())
  print("\n".join(run_document(doc, box)))  # seconds per command, with -s
  if doc == "docs/performance.md":  # and what the benchmark scripts wrote
    benchmark_checks.check_all(os.path.join(box.root, "bench-results"),
                               BENCH_TINY_GIN.split("=", 1)[1], BENCH_MEMORY_GIN.split("=", 1)[1])


# ---------------------------------------------------------------------------
# The gin reference


REFERENCE = "docs/gin_reference.md"
# Aliases the shipped gin files import.
ALIASES = {"train_lib": "t5lite.train", "checkpoints": "t5lite.checkpoints",
           "partitioning": "t5lite.partitioning", "trainer": "t5lite.trainer",
           "datasets": "t5lite.data.datasets", "file_tasks": "t5lite.data.file_tasks",
           "vocabularies": "t5lite.data.vocabularies",
           "models": "t5lite.models.models", "transformer": "t5lite.models.transformer",
           "optimizers": "t5lite.optimizers", "decoding": "t5lite.decoding",
           "actions": "t5lite.actions", "evaluate": "t5lite.evaluate"}


def _reference_sections() -> dict[str, list[tuple[str, str]]]:
  """`alias.Name` -> [(parameter, default cell)] from the reference's tables."""
  text = open(os.path.join(REPO, REFERENCE), encoding="utf-8").read()
  sections = {}
  for match in re.finditer(r"^### `([\w.]+)`\n(.*?)(?=^#|\Z)", text, re.M | re.S):
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| .* \|$", match.group(2), re.M)
    sections[match.group(1)] = rows
  return sections


def _shipped_macros() -> set[str]:
  macros = set()
  for path in glob.glob(os.path.join(REPO, "gin", "**", "*.gin"), recursive=True):
    text = open(path, encoding="utf-8").read()
    macros |= set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*=", text, re.M))
  return macros


def test_reference_mentions_every_macro_of_the_shipped_gin_files():
  text = open(os.path.join(REPO, REFERENCE), encoding="utf-8").read()
  macros = text.split("## Macros", 1)[1].split("## Configurables", 1)[0]
  missing = sorted(m for m in _shipped_macros() if f"`{m}`" not in macros)
  assert not missing, f"{REFERENCE} does not describe the macros {missing}"


def test_reference_tables_match_the_signatures():
  sections = _reference_sections()
  assert "train_lib.train" in sections and len(sections) >= 20
  for name, rows in sections.items():
    alias, attr = name.split(".", 1)
    target = getattr(importlib.import_module(ALIASES[alias]), attr)
    params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    expected = [(p.name, "required" if p.default is inspect.Parameter.empty
                 else f"`{p.default!r}`") for p in params]
    assert rows == expected, f"{REFERENCE} `{name}`: the table has\n{rows}\nbut the code\n" \
                             f"{expected}"


def test_reference_covers_every_parameter_of_train():
  from t5lite import train
  documented = [name for name, _ in _reference_sections()["train_lib.train"]]
  assert documented == list(inspect.signature(train.train).parameters)


def test_reference_covers_every_configurable_the_gin_files_bind():
  bound = set()
  for path in glob.glob(os.path.join(REPO, "gin", "**", "*.gin"), recursive=True):
    text = open(path, encoding="utf-8").read()
    bound |= set(re.findall(r"^(?:\w+/)?(\w+\.[A-Za-z_]\w*)(?:\.\w+\s*=|:)", text, re.M))
  flax_modules = {"transformer.EncoderDecoder", "transformer.DecoderOnly"}  # only `.config`
  missing = sorted(bound - set(_reference_sections()) - flax_modules)
  assert not missing, f"{REFERENCE} has no table for {missing}"
