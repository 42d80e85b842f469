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
