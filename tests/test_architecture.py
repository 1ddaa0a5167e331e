"""The layout's rules, checked on the source (docs/architecture.md explains them).

The stages are the package's folders, in the order ``captioning.STAGES`` gives (the data's path:
data → model → train → inference → evaluation → benchmarks → cli); the modules directly in
``captioning/`` are the base every stage uses. A module imports the base and modules of its own stage or
earlier ones; ``data_prep`` (the writing half) shares only the base and the record format
(``captioning.data.schema``, ``captioning.data.prepared``) with ``captioning``; only the command line and
the benchmarks import ``data_prep``. No import cycle anywhere, counting imports inside functions.
"""

import ast
import doctest
import importlib
import os
import re

import pytest

import captioning
from tests.harness.source import MODULES, imports_of_test_modules
from tests.harness.source import imports as _imports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "captioning")
MAX_LINES = 400  # of any module of captioning/ and data_prep/, without exemptions
MAX_FUNCTION_LINES = 80  # of any function or method of captioning/ and data_prep/, nested ones on their own
FORMAT = {"captioning.data.schema", "captioning.data.prepared", "captioning.data.scenes",
          "captioning.data.features_store"}  # what data_prep may read
# of the data stage
BOTH_HALVES = ("benchmarks", "cli")  # the stages that wire data_prep in


def stage(module: str) -> int:
    """-1 for the base modules (and the package itself), else the index of the module's folder in
    ``captioning.STAGES``."""
    parts = module.split(".")
    if module == "captioning.__main__":  # ``python -m captioning``: the command line
        return captioning.STAGES.index("cli")
    if len(parts) < 2 or parts[1] in captioning.BASE_PACKAGES or (
            f"captioning.{parts[1]}" in MODULES and not os.path.isdir(os.path.join(PACKAGE, parts[1]))):
        return -1
    return captioning.STAGES.index(parts[1])


def test_the_stages_are_the_folders():
    folders = sorted(name for name in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py")))
    assert folders == sorted(captioning.STAGES + captioning.BASE_PACKAGES)


def test_no_stage_imports_a_later_one():
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("captioning"):
            continue
        for imported in _imports(path):
            if imported.startswith("data_prep"):
                if stage(module) < 0 or captioning.STAGES[stage(module)] not in BOTH_HALVES:
                    wrong.append(f"{module} imports {imported}: only {' and '.join(BOTH_HALVES)} import data_prep")
            elif stage(imported) > stage(module):
                wrong.append(f"{module} (stage {stage(module)}) imports {imported} (stage {stage(imported)})")
    assert wrong == []


def test_data_prep_shares_only_the_base_and_the_record_format():
    wrong = [f"{module} imports {imported}" for module, path in MODULES.items() if module.startswith("data_prep")
             for imported in _imports(path) if imported.startswith("captioning")
             and stage(imported) >= 0 and imported not in FORMAT and imported != "captioning.data"]
    assert wrong == []


def _cycles():
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere():
    assert _cycles() == []


def _test_files():
    """Every module of tests/: the test modules (``test_*.py``), the harness (tests/harness/, tests/helpers.py,
    tests/conftest.py) and the scripts the tests run in processes of their own (tests/distributed_worker.py, whose
    scenarios live in the harness, tests/data_service_consumer.py, tests/rewrite_cache.py), and the files a test
    registers components from (tests/data/)."""
    tests = os.path.join(ROOT, "tests")
    for folder, folders, files in os.walk(tests):
        folders[:] = sorted(f for f in folders if f != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_test_module_imports_another(tmp_path):
    """Shared builders live in the harness (tests/harness/, tests/helpers.py, conftest.py's fixtures): no module of
    tests/ (a test module, the harness, or a script a test runs, such as tests/distributed_worker.py) imports a test
    module, in any of the ways Python can."""
    planted = tmp_path / "test_planted.py"  # what the check finds: each way, at the top and inside a function
    planted.write_text("import tests.test_a\nfrom tests.test_b import x\nfrom tests import test_c, helpers\n"
                       "import test_d\nfrom .test_e import y\nfrom . import test_f\nfrom tests.harness import models\n"
                       "from tests.harness.encoder_contract import run_encoder_test\n"
                       "def f():\n    from tests.test_g import z\n    importlib.import_module('tests.test_h')\n"
                       "MODES = {'x': lambda: __import__('tests.test_i', fromlist=['y']).y()}\n")
    assert {name for _, name in imports_of_test_modules(planted)} == {
        "tests.test_a", "tests.test_b", "tests.test_c", "test_d", "test_e", "test_f", "tests.test_g", "tests.test_h",
        "tests.test_i"}
    files = {os.path.relpath(path, ROOT) for path in _test_files()}
    assert len(files) > 60 and {"tests/harness/models.py", "tests/helpers.py", "tests/conftest.py",
                                "tests/distributed_worker.py", "tests/data_service_consumer.py",
                                "tests/rewrite_cache.py", "tests/test_architecture.py"} <= files
    wrong = [f"{path}:{line} imports {name}" for path in sorted(files)
             for line, name in imports_of_test_modules(os.path.join(ROOT, path))]
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


@pytest.mark.parametrize("file_name, owner", [("manifest.json", "captioning/data/prepared.py"),
                                              ("store.json", "captioning/data/features_store.py"),
                                              ("config.yaml", "captioning/model/folder.py"),
                                              ("history.yaml", "captioning/model/folder.py")])
def test_only_the_hand_off_type_names_its_files(file_name, owner):
    """A hand-off folder's file names are constants of its one module; others use that module."""
    users = sorted(os.path.relpath(path, ROOT) for path in MODULES.values()
                   if any(s == file_name for s in _code_strings(path)))
    assert users == [owner]


def _name_tests(path):
    """(line, text) of each comparison of a ``decoder`` or ``objective`` (a name or an attribute) with a
    string: code that branches on which decoder or objective it has."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(n, (ast.Name, ast.Attribute)) and (getattr(n, "id", None) or n.attr) in
                    ("decoder", "objective") for n in sides)
        strings = any(isinstance(n, ast.Constant) and isinstance(n.value, str) or
                      isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(isinstance(e, ast.Constant)
                                                                             for e in n.elts) for n in sides)
        if named and strings:
            yield node.lineno, ast.unparse(node)


def test_no_code_branches_on_a_decoders_or_an_objectives_name(tmp_path):
    """Decoders and objectives are asked (what they declare), never tested by name."""
    planted = tmp_path / "planted.py"  # what the check finds
    planted.write_text("if cfg.model.decoder == 'attention' or objective in ('scst',):\n    pass\n")
    assert [line for line, _ in _name_tests(planted)] == [1, 1]  # both comparisons
    wrong = [(os.path.relpath(path, ROOT), line, text) for path in MODULES.values()
             for line, text in _name_tests(path)]
    assert wrong == []


SOURCE_NAMES = ("images", "regions")  # captioning.model.data_sources.DATA_SOURCES' names (checked below)
SOURCES_PACKAGE = os.path.join(PACKAGE, "model", "data_sources")


def _source_tests(path):
    """(line, text) of each test of which data source a config or a model has: a comparison (``==``, ``!=``, or
    ``in`` a written collection of sources' names) with a data source's name, and any use of ``reads_regions``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) == "reads_regions":
            yield node.lineno, ast.unparse(node)
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq)):
                named = [n for n in (left, right) if isinstance(n, ast.Constant) and n.value in SOURCE_NAMES]
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                values = [e.value for e in right.elts if isinstance(e, ast.Constant)]  # sources' names only
                named = values if values and all(value in SOURCE_NAMES for value in values) else []
            else:
                named = []
            if named:
                yield node.lineno, ast.unparse(node)
                break


def test_no_code_branches_on_a_data_sources_name(tmp_path):
    """What a model reading boxes differs in lives in its data source (captioning/model/data_sources/): the other
    stages ask the source they are handed (or their model's, ``model.source``), and never test ``data.features``'s
    value or whether a model reads regions."""
    from captioning.model.data_sources import DATA_SOURCES

    assert tuple(DATA_SOURCES) == SOURCE_NAMES
    planted = tmp_path / "planted.py"  # what the check finds, and what it leaves (a batch's key, a decoder's kind)
    planted.write_text("if cfg.features == 'regions' or data.features in ('images',) or 'regions' != kind:\n"
                       "    pass\nif model.reads_regions and 'regions' in batch and cls.features == 'pooled':\n"
                       "    pass\nif stage in ('images', 'encoder'):\n    pass\n")
    assert sorted(line for line, _ in _source_tests(planted)) == [1, 1, 1, 3]  # three comparisons, one attribute
    wrong = [(os.path.relpath(path, ROOT), line, text) for path in MODULES.values()
             if not path.startswith(SOURCES_PACKAGE + os.sep) for line, text in _source_tests(path)]
    assert wrong == []


def test_no_environment_variables_as_signals_between_modules():
    for path in MODULES.values():
        text = open(path, encoding="utf-8").read()
        assert not re.search(r"environ[^\n]*[\"']CAPTIONING_", text), path


def test_every_traced_function_is_written_without_autograph():
    """Every ``tf.function`` of captioning/ and data_prep/ says ``autograph=False``: the graph code is plain TensorFlow
    (docs/architecture.md, "Graph code without AutoGraph"). tests/conftest.py's ``graph_code_without_autograph``
    checks in every test what this cannot see: tf.data's functions, and a conversion asked for at run time."""
    without = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            calls = [node] if isinstance(node, ast.Call) else []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a bare @tf.function
                calls = [d for d in node.decorator_list if not isinstance(d, ast.Call)]
            for call in calls:
                target = call.func if isinstance(call, ast.Call) else call
                if isinstance(target, ast.Attribute) and target.attr == "function" and \
                        getattr(target.value, "id", None) == "tf" and not any(
                            k.arg == "autograph" and getattr(k.value, "value", None) is False
                            for k in getattr(call, "keywords", ())):
                    without.append(f"{module}:{call.lineno}")
    assert without == []


def test_every_module_has_at_most_400_lines():
    """No module of captioning/ or data_prep/ is longer than MAX_LINES, and none is exempt: a module that
    grows past it is split by responsibility (as config.py was into settings, sections, migrations and the
    loader)."""
    assert len(MODULES) > 100 and {"captioning.config", "data_prep.prepare"} <= set(MODULES)
    long = {os.path.relpath(path, ROOT): n for path in MODULES.values()
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > MAX_LINES}
    assert long == {}


def _function_lengths(path):
    """(qualified name, lines) of every function and method of a file, nested ones as well: from its first
    decorator to its last line, docstring included (a nested function's lines count in its parent too)."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    yield name, child.end_lineno - first + 1
                yield from visit(child, name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(open(path, encoding="utf-8").read()), "")


def test_every_function_has_at_most_80_lines(tmp_path):
    """No function or method of captioning/ or data_prep/ (a nested one counted on its own) is longer than
    MAX_FUNCTION_LINES, and none is exempt: a longer one is split by responsibility into named functions that
    read top to bottom."""
    planted = tmp_path / "planted.py"  # what the check finds: a method, a nested function, a decorated one
    planted.write_text("class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n"
                       + "        x = 1\n" * 3)
    assert dict(_function_lengths(planted)) == {"A.f": 7, "A.f.g": 2}
    long = {f"{os.path.relpath(path, ROOT)}:{name}": lines for path in MODULES.values()
            for name, lines in _function_lengths(path) if lines > MAX_FUNCTION_LINES}
    assert long == {}


@pytest.mark.parametrize("module", sorted(m for m, path in MODULES.items()
                                          if ">>> " in open(path, encoding="utf-8").read()))
def test_docstring_examples(module):
    """The worked examples in docstrings run as written."""
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
