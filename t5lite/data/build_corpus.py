"""Builds the embedded English corpus and the shipped SentencePiece model.

The corpus is the prose found in CPython 3.11's standard library: module,
class and function docstrings and whole-line comment blocks of the
pure-Python modules (test modules skipped), docstrings of the compiled-in
modules, and the language-reference topics `pydoc` shows. Code, doctests and
markup are filtered out, paragraphs are normalised to one line each,
duplicates dropped, and every 20th line is held out for validation (about
2.1 MB of text in all). The output depends only on the interpreter, so
regenerating it with the same CPython release gives byte-identical files;
they are shipped so that training never downloads anything.

Usage: python -m t5lite.data.build_corpus [--out_dir DIR] [--vocab_dir DIR]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import inspect
import io
import pathlib
import re
import sys
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator

from t5lite.data import vocabularies
from t5lite.errors import UserError


CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "corpus"
CORPUS_NAME = "stdlib_docs"
SPLITS = ("train", "validation")
VALIDATION_EVERY = 20
SPM_VOCAB_SIZE = 2000

# Top-level entries that are tests, test fixtures or third-party code.
_SKIPPED_TOP_LEVEL = ("site-packages", "test", "ensurepip", "__phello__", "__hello__.py")
_SKIPPED_DIR_PARTS = ("test", "tests", "idle_test")
_MIN_WORDS = 8
_MIN_SENTENCE_WORDS = 5
_CODE_SYMBOLS = frozenset("{}[]<>=_|\\@#$%^&*`~")
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)*:`([^`]*)`")
_LITERAL = re.compile(r"`+([^`]+)`+")
_EMPHASIS = re.compile(r"\*{1,2}([^*\s](?:[^*]*[^*\s])?)\*{1,2}")
_PLAIN_WORD = re.compile(r"^[(\"']?[A-Za-z][a-z]*(?:'[a-z]+)?[)\"']?[.,;:!?]?[)\"']?$")
_RULE_LINE = re.compile(r"^\s*([=\-*~^#+])\1{2,}\s*$")
_DIRECTIVE_LINE = re.compile(r"^\s*\.\. ")
_BULLET = re.compile(r"^(?:[*\-+]|\d+\.|\(\d+\))\s+")


def corpus_file(split: str, directory: pathlib.Path = CORPUS_DIR) -> pathlib.Path:
  """Returns the gzip file holding one split of the corpus.

  Args:
    split: "train" or "validation".
    directory: folder holding the corpus files.

  Returns:
    `<directory>/stdlib_docs_<split>.txt.gz`.

  Raises:
    ValueError: for an unknown split.
  """
  if split not in SPLITS:
    raise UserError(f"Unknown corpus split '{split}'. Allowed: {', '.join(SPLITS)}.")
  return directory / f"{CORPUS_NAME}_{split}.txt.gz"


def _is_test_module(relative: pathlib.Path) -> bool:
  """True for files under test packages or named like test modules."""
  parts = relative.parts
  if parts[0] in _SKIPPED_TOP_LEVEL or parts[0].startswith("config-"):
    return True
  if any(part in _SKIPPED_DIR_PARTS for part in parts[:-1]):
    return True
  return relative.name.startswith("test_")


def _docstrings(tree: ast.AST) -> Iterator[str]:
  """Yields the docstrings of a parsed module and of its classes and functions."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=True)
      if doc:
        yield doc


def _comment_blocks(source: str) -> Iterator[str]:
  """Yields runs of consecutive whole-line comments, '#' markers removed.

  Comments in the standard library are often full explanatory paragraphs;
  trailing comments after code are skipped as they are rarely sentences.
  """
  block: list[str] = []
  last_row = -2
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type != tokenize.COMMENT or token.line.strip() != token.string.strip():
      continue
    row = token.start[0]
    if row != last_row + 1 and block:
      yield "\n".join(block)
      block = []
    block.append(token.string.lstrip("#").strip())
    last_row = row
  if block:
    yield "\n".join(block)


def _source_texts(stdlib: pathlib.Path) -> Iterator[str]:
  """Yields docstrings and comment blocks of the stdlib's non-test .py files."""
  for path in sorted(stdlib.rglob("*.py")):
    relative = path.relative_to(stdlib)
    if _is_test_module(relative):
      continue
    try:
      source = path.read_text(encoding="utf-8")
      tree = ast.parse(source)
      comments = list(_comment_blocks(source))
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
      # A few files are deliberately broken or non-UTF-8 fixtures.
      continue
    yield from _docstrings(tree)
    yield from comments


def _object_docstrings(obj: object) -> Iterator[str]:
  """Yields the docstring of a compiled object and of its direct members."""
  members = [obj]
  for name in sorted(dir(obj)):
    try:
      members.append(getattr(obj, name))
    except AttributeError:
      continue
  for member in members:
    if inspect.ismodule(member) or inspect.isclass(member) or inspect.isroutine(member):
      doc = inspect.getdoc(member)
      if doc:
        yield doc


def _builtin_docstrings() -> Iterator[str]:
  """Yields docstrings of modules compiled into the interpreter and their classes."""
  for name in sorted(sys.builtin_module_names):
    module = importlib.import_module(name)
    for doc in _object_docstrings(module):
      yield doc
    for _, cls in sorted(inspect.getmembers(module, inspect.isclass)):
      if cls.__module__ == module.__name__:
        yield from _object_docstrings(cls)


def _topic_texts() -> Iterator[str]:
  """Yields the language-reference topics that `pydoc` shows (e.g. 'assignment')."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  for key in sorted(topics.topics):
    yield topics.topics[key]


def _strip_markup(paragraph: str) -> str:
  """Removes reST roles, literal quotes and emphasis, keeping their text."""
  paragraph = _ROLE.sub(r"\1", paragraph)
  paragraph = _LITERAL.sub(r"\1", paragraph)
  return _EMPHASIS.sub(r"\1", paragraph)


def paragraphs(text: str) -> Iterator[str]:
  """Splits text into blank-line separated paragraphs, each on one line.

  Heading underlines, reST directives, markup and bullet markers are
  removed and runs of whitespace collapse to one space. Blocks whose first
  line is indented are reST literal (code) blocks and are dropped.

  Args:
    text: a docstring, comment block or topic text.

  Yields:
    Normalised paragraphs (possibly still code; see `is_prose`).
  """
  for block in re.split(r"\n\s*\n", text):
    lines = [
        line
        for line in block.splitlines()
        if not _RULE_LINE.match(line) and not _DIRECTIVE_LINE.match(line)
    ]
    if not lines or lines[0][:1].isspace():
      continue
    paragraph = _BULLET.sub("", " ".join(line.strip() for line in lines))
    paragraph = re.sub(r"\s+", " ", _strip_markup(paragraph)).strip()
    if paragraph:
      yield paragraph


def is_prose(paragraph: str) -> bool:
  """Heuristically decides whether a paragraph is English prose, not code.

  Args:
    paragraph: one normalised paragraph.

  Returns:
    True when the paragraph is ASCII, has no doctest prompt or grammar
    rule, is a sentence of at least 5 words (or any run of 8+ words),
    consists mostly of plain words and has few code symbols.
  """
  if not paragraph.isascii() or ">>>" in paragraph or "::=" in paragraph:
    return False
  if not (paragraph[0].isalpha() or paragraph[0] in "(\"'"):
    return False
  words = paragraph.split()
  if len(words) < _MIN_SENTENCE_WORDS:
    return False
  if len(words) < _MIN_WORDS and paragraph[-1] not in ".?!":
    return False
  plain = sum(1 for word in words if _PLAIN_WORD.match(word))
  symbols = sum(1 for ch in paragraph if ch in _CODE_SYMBOLS)
  return plain >= 0.75 * len(words) and symbols <= 0.02 * len(paragraph)


def corpus_lines(texts: Iterable[str]) -> list[str]:
  """Returns the distinct prose paragraphs of `texts`, in first-seen order.

  Args:
    texts: raw docstrings, comment blocks or topic texts.

  Returns:
    One paragraph per entry, no duplicates.
  """
  seen: set[str] = set()
  lines = []
  for text in texts:
    for paragraph in paragraphs(text):
      if paragraph not in seen and is_prose(paragraph):
        seen.add(paragraph)
        lines.append(paragraph)
  return lines


def split_lines(lines: list[str]) -> dict[str, list[str]]:
  """Holds out every `VALIDATION_EVERY`-th line for validation.

  Args:
    lines: the whole corpus.

  Returns:
    {"train": [...], "validation": [...]}; disjoint, together all lines.
  """
  held_out = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(lines))]
  return {
      "train": [line for line, out in zip(lines, held_out) if not out],
      "validation": [line for line, out in zip(lines, held_out) if out],
  }


def write_gzip_lines(path: pathlib.Path, lines: list[str]) -> None:
  """Writes lines gzip-compressed, with no timestamp or name in the header.

  Args:
    path: destination file.
    lines: text lines without newlines.
  """
  data = "".join(f"{line}\n" for line in lines).encode("utf-8")
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "wb") as raw:
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
      f.write(data)


def build(
    out_dir: pathlib.Path = CORPUS_DIR, vocab_dir: pathlib.Path = vocabularies.VOCAB_DIR
) -> dict[str, int]:
  """Regenerates the corpus splits and trains the shipped SentencePiece model.

  Args:
    out_dir: where the corpus `.txt.gz` files are written.
    vocab_dir: where the `.model` file is written.

  Returns:
    Line counts per split.

  Raises:
    ValueError: when not run on CPython 3.11, whose standard library
      defines the corpus.
  """
  if sys.version_info[:2] != (3, 11):
    raise UserError(
        "The corpus is defined by CPython 3.11's standard library; this is "
        f"Python {sys.version.split()[0]}. Run the script with Python 3.11."
    )
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  texts = [*_source_texts(stdlib), *_builtin_docstrings(), *_topic_texts()]
  splits = split_lines(corpus_lines(texts))
  for split, lines in splits.items():
    write_gzip_lines(corpus_file(split, out_dir), lines)
  model_prefix = vocab_dir / vocabularies.DEFAULT_SPM_MODEL.stem
  vocabularies.train_sentencepiece([corpus_file("train", out_dir)], model_prefix, SPM_VOCAB_SIZE)
  return {split: len(lines) for split, lines in splits.items()}


def main(argv: list[str] | None = None) -> None:
  """Command-line entry point: rebuilds the corpus and vocabulary in place."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument(
      "--out_dir", type=pathlib.Path, default=CORPUS_DIR, help="corpus output folder"
  )
  parser.add_argument(
      "--vocab_dir",
      type=pathlib.Path,
      default=vocabularies.VOCAB_DIR,
      help="SentencePiece model output folder",
  )
  args = parser.parse_args(argv)
  counts = build(args.out_dir, args.vocab_dir)
  print(", ".join(f"{split}: {n} lines" for split, n in counts.items()))


if __name__ == "__main__":
  main()
