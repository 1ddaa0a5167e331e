"""The layout's rules, checked on the source (docs/architecture.md explains them).

The data takes one path: prepare → record format → input pipeline → model → train → decode/evaluate →
command line. A module imports only modules of its own stage or of stages before it; ``data_prep`` (the
writing half) shares only the base and format modules with ``captioning``; only the command line imports
both. The two folders stages hand each other have one module each that knows their files.
"""

import ast
import doctest
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# captioning's stages, in the data's order (a module may import its own stage and those above it here)
STAGES = [
    ("base", ["captioning", "captioning.errors", "captioning.fileio", "captioning.config", "captioning.tf_import",
              "captioning.tf_internals", "captioning.service_probe"]),
    ("format", ["captioning.schema", "captioning.text", "captioning.vocab", "captioning.images",
                "captioning.dataset"]),
    ("data", ["captioning.augment", "captioning.batching", "captioning.disk_cache", "captioning.feature_cache",
              "captioning.integrity", "captioning.input_pipeline", "captioning.data_service"]),
    ("model", ["captioning.model", "captioning.model_dir"]),
    ("train", ["captioning.train"]),
    ("use", ["captioning.inference", "captioning.evaluate", "captioning.metrics", "captioning.caption",
             "captioning.grounding", "captioning.export"]),
    ("cli", ["captioning.cli", "captioning.__main__"]),
]
# modules that may be longer than ~350 lines, each because one responsibility needs it (said in its docstring)
LONG_MODULES = {"captioning/config.py", "captioning/integrity.py", "captioning/model_dir.py"}


def _modules():
    """(module name, path) of every module of captioning and data_prep."""
    for package in ("captioning", "data_prep"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield module.removesuffix(".__init__"), path


def _imports(path):
    """The captioning/data_prep modules a file imports (``from a.b import c`` counts as ``a.b``)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("captioning", "data_prep"):
                yield name


def _stage(module: str) -> int:
    """The index of ``module``'s stage: the stage listing it or its longest listed parent package."""
    best = None
    for index, (_, members) in enumerate(STAGES):
        for member in members:
            if (module == member or module.startswith(member + ".")) and (best is None or len(member) > best[1]):
                best = (index, len(member))
    assert best is not None, f"{module} is in no stage: add it to STAGES in {__file__}"
    return best[0]


def test_every_module_has_a_stage():
    for module, _ in _modules():
        if module.startswith("captioning"):
            _stage(module)


def test_no_stage_imports_a_later_one():
    wrong = []
    for module, path in _modules():
        if not module.startswith("captioning"):
            continue
        for imported in _imports(path):
            if imported.startswith("data_prep"):
                if _stage(module) != len(STAGES) - 1:
                    wrong.append(f"{module} imports {imported}: only the command line imports data_prep")
            elif imported != "captioning" and _stage(imported) > _stage(module):
                wrong.append(f"{module} ({STAGES[_stage(module)][0]}) imports {imported} "
                             f"({STAGES[_stage(imported)][0]})")
    assert wrong == []


def test_data_prep_shares_only_the_base_and_format_modules():
    allowed = {m for _, members in STAGES[:2] for m in members}
    wrong = [f"{module} imports {imported}" for module, path in _modules() if module.startswith("data_prep")
             for imported in _imports(path) if imported.startswith("captioning") and imported not in allowed]
    assert wrong == []


def _code_strings(path):
    """String constants of a file that are not docstrings."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


@pytest.mark.parametrize("file_name, owner", [("manifest.json", "captioning/dataset.py"),
                                              ("config.yaml", "captioning/model_dir.py"),
                                              ("history.yaml", "captioning/model_dir.py")])
def test_only_the_hand_off_type_names_its_files(file_name, owner):
    """A hand-off folder's file names are constants of its one module; others use that module."""
    users = sorted(os.path.relpath(path, ROOT) for _, path in _modules()
                   if any(s == file_name for s in _code_strings(path)))
    assert users == [owner]


def test_no_environment_variables_as_signals_between_modules():
    for _, path in _modules():
        text = open(path, encoding="utf-8").read()
        assert not re.search(r"environ[^\n]*[\"']CAPTIONING_", text), path


def test_modules_stay_small_or_say_why():
    for _, path in _modules():
        rel = os.path.relpath(path, ROOT)
        lines = sum(1 for _ in open(path, encoding="utf-8"))
        if rel in LONG_MODULES:
            assert "one responsibility" in (ast.get_docstring(ast.parse(open(path).read())) or ""), rel
        else:
            assert lines <= 360, f"{rel} has {lines} lines"


@pytest.mark.parametrize("module", sorted(m for m, path in _modules()
                                          if ">>> " in open(path, encoding="utf-8").read()))
def test_docstring_examples(module):
    """The worked examples in docstrings run as written."""
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
