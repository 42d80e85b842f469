"""The import rules of the layout: models answer model questions, and the
entry points share modules instead of reaching into each other."""

import ast
import os

import t5lite


PACKAGE = os.path.dirname(t5lite.__file__)


def _imports(module: str) -> tuple[set[str], set[str], ast.Module]:
  """(modules imported, names imported from t5lite modules, the parsed source).

  Imports under `if TYPE_CHECKING:` do not count: they name a type for the
  annotations and run nothing."""
  with open(os.path.join(PACKAGE, *module.split(".")[1:]) + ".py", encoding="utf-8") as f:
    tree = ast.parse(f.read())
  typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
  modules, names = set(), set()
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      modules.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      modules.add(node.module)
      for alias in node.names:
        modules.add(f"{node.module}.{alias.name}")
        if node.module.startswith("t5lite"):
          names.add(alias.name)
  return modules, names, tree


def test_train_imports_nothing_from_models():
  modules, _, _ = _imports("t5lite.train")
  assert not [m for m in modules if m.startswith("t5lite.models")]


def test_evaluate_imports_neither_train_nor_private_names():
  modules, names, tree = _imports("t5lite.evaluate")
  assert "t5lite.train" not in modules
  assert not [n for n in names if n.startswith("_")]
  bound = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
           and (node.module or "").startswith("t5lite") for a in node.names}
  private = [f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id in bound and node.attr.startswith("_")]
  assert not private, private


def _gin_configurable(node: ast.FunctionDef) -> bool:
  """Whether a `@gin.configurable` (called or not) decorates the function."""
  for decorator in node.decorator_list:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if ast.unparse(target) in ("gin.configurable", "configurable"):
      return True
  return False


def _required(node: ast.FunctionDef) -> list[str]:
  """Parameters without a default, besides self and cls."""
  args = node.args
  positional = args.posonlyargs + args.args
  names = [a.arg for a in positional[:len(positional) - len(args.defaults)]]
  names += [a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults) if default is None]
  return [n for n in names if n not in ("self", "cls")]


def test_no_function_takes_more_than_eight_required_parameters():
  # More means a settings object (`RunConfig`) or a decision already made
  # should be passed instead; gin entry points keep their keyword arguments.
  crowded = []
  for root, _, files in os.walk(PACKAGE):
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not _gin_configurable(node) and len(_required(node)) > 8):
          crowded.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} {node.name} "
                         f"({len(_required(node))})")
  assert not crowded, crowded


def test_train_module_stays_under_500_lines():
  with open(os.path.join(PACKAGE, "train.py"), encoding="utf-8") as f:
    assert len(f.read().splitlines()) < 500


def _module_names() -> dict[str, str]:
  """Every module of the package, by dotted name, with its file."""
  found = {}
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        parts = os.path.relpath(os.path.join(root, name), os.path.dirname(PACKAGE))[:-3]
        dotted = parts.replace(os.sep, ".").removesuffix(".__init__")
        found[dotted] = os.path.join(root, name)
  return found


def _run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
  """The statements of `body` that run when the module is imported: those
  inside functions do not, nor those under `if TYPE_CHECKING:`."""
  found = []
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      found.extend(_run_at_import(node.orelse))
      continue
    found.append(node)
    for field in ("body", "orelse", "finalbody", "handlers"):
      found.extend(_run_at_import(getattr(node, field, [])))
  return found


def _imported_at_import(module: str, path: str, modules: set[str]) -> set[str]:
  """The package's modules `module` imports when it is imported."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  imported = set()
  for node in _run_at_import(tree.body):
    if isinstance(node, ast.Import):
      imported.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1],
                         *([base] if base else [])])
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        imported.add(submodule if submodule in modules else base)
  return {m for m in imported if m in modules and m != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A path of imports that leads a module back to itself, or None."""
  done: set[str] = set()

  def visit(module: str, path: list[str]) -> list[str] | None:
    if module in path:
      return path[path.index(module):] + [module]
    if module in done:
      return None
    for imported in sorted(graph[module]):
      found = visit(imported, [*path, module])
      if found:
        return found
    done.add(module)
    return None

  for module in sorted(graph):
    found = visit(module, [])
    if found:
      return found
  return None


def test_cycle_finder_finds_a_cycle_and_only_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_itself_through_others():
  """A module imported at import time by one it imports is half-initialised
  when that one runs: which names exist then depends on which was imported
  first. Imports inside functions run later and are allowed."""
  modules = _module_names()
  graph = {m: _imported_at_import(m, path, set(modules)) for m, path in modules.items()}
  assert graph["t5lite.train"], "no imports found: the parser is broken"
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
