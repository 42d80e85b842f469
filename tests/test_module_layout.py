"""The import rules of the layout: models answer model questions, and the
entry points share modules instead of reaching into each other."""

import ast
import os

import t5lite

PACKAGE = os.path.dirname(t5lite.__file__)


def _imports(module: str) -> tuple[set[str], set[str], ast.Module]:
  """(modules imported, names imported from t5lite modules, the parsed source)."""
  with open(os.path.join(PACKAGE, *module.split(".")[1:]) + ".py", encoding="utf-8") as f:
    tree = ast.parse(f.read())
  modules, names = set(), set()
  for node in ast.walk(tree):
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
