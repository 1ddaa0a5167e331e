"""The project's modules and what each imports, read from the source (tests/test_architecture.py's rules and
tests/test_docs.py's checks of the architecture page read them); and what each file of tests/ imports of the
test modules, which none may."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules():
    """(module name, path) of every module of captioning and data_prep."""
    for package in ("captioning", "data_prep"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield module.removesuffix(".__init__"), path

MODULES = dict(_modules())

def imports(path):
    """The captioning/data_prep modules a file imports, anywhere in it (``from a.b import c`` counts as
    ``a.b.c`` when that is a module, else ``a.b``)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("captioning", "data_prep"):
                yield name


def is_test_module(name: str) -> bool:
    """Whether a dotted module name is a test module's (the file pytest collects: ``test_*.py`` or ``*_test.py``)."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last.endswith("_test")


def imports_of_test_modules(path):
    """(line, module) of every import of a test module in the file at ``path``, anywhere in it: ``import tests.test_x``,
    ``from tests.test_x import y``, ``from tests import test_x``, ``import test_x`` (with tests/ on the path),
    ``from .test_x import y``, ``from . import test_x``, and ``importlib.import_module`` or ``__import__`` of such a
    name given as a string."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # a name imported from a module is a module if it is named test_*
            names = [node.module] if node.module and is_test_module(node.module) else \
                [f"{node.module or ''}.{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        else:
            continue
        for name in names:
            if is_test_module(name):
                yield node.lineno, name.lstrip(".")
