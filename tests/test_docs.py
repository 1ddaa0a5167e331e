"""The docs cannot go stale: docs/architecture.md names every module and only modules that exist, the
registries it names exist, and every `captioning` command the README and the docs show parses with
today's flags, its config files exist and its `--set` keys are config keys."""

import importlib
import os
import re
import shlex

import pytest

from tests.helpers import REPO

DOCS = [os.path.join(REPO, "README.md")] + sorted(
    os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")


def modules():
    """Every module file as the architecture page names it: relative to captioning/ (``data/pipeline.py``)
    or to the repository (``data_prep/shapes.py``); package faces only where they hold a registry or
    code of their own."""
    for package in ("captioning", "data_prep"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                text = open(path, encoding="utf-8").read()
                if name in ("__init__.py", "__main__.py") and not re.search(r"^(def |[A-Z_]+: |[A-Z_]+ = )", text, re.M):
                    continue  # a docstring (and re-exports): the folder's face
                rel = os.path.relpath(path, os.path.join(REPO, "captioning" if package == "captioning" else ""))
                yield rel


def test_the_architecture_page_names_every_module_and_no_other():
    text = open(ARCHITECTURE, encoding="utf-8").read()
    missing = sorted(m for m in modules() if f"`{m}`" not in text)
    assert missing == [], f"docs/architecture.md does not name {missing}"
    named = set(re.findall(r"`([\w/]+\.py)`", text))
    stale = sorted(n for n in named if not any(os.path.exists(os.path.join(REPO, base, n))
                                               for base in ("", "captioning")))
    assert stale == [], f"docs/architecture.md names files that do not exist: {stale}"


def test_the_registries_and_stages_the_docs_name_exist():
    import captioning

    text = open(ARCHITECTURE, encoding="utf-8").read()
    names = set(re.findall(r"`(captioning(?:\.\w+)+\.[A-Z][A-Z_]+)`", text))
    assert {"captioning.model.DECODERS", "captioning.train.objectives.OBJECTIVES"} <= names
    for name in names:
        module, _, attribute = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), attribute), dict), name
    order = re.search(r"`data`(\s+→\s+`\w+`)+", text)  # the stages, in the order the page gives them
    assert order and tuple(re.findall(r"`(\w+)`", order.group(0))) == captioning.STAGES


def _doc_name(module: str) -> str:
    """A module as the architecture page writes it: ``data/schema.py``, ``cli/__init__.py``,
    ``data_prep/records.py``."""
    from tests.harness.source import MODULES

    path = os.path.relpath(MODULES[module], REPO)
    return path if module.startswith("data_prep") else os.path.relpath(path, "captioning")


def _importers(target: str) -> set[str]:
    """The modules (page names) that import ``target``: a module's page name, or a folder (``data_prep/``)
    for any module in it, counting imports inside functions (tests/test_architecture.py's reading)."""
    from tests.harness.source import MODULES, imports

    def hit(name):
        return name in MODULES and (_doc_name(name).startswith(target) if target.endswith("/")
                                    else _doc_name(name) == target)

    return {_doc_name(m) for m, path in MODULES.items() if not hit(m) and any(hit(i) for i in imports(path))}


def _imported_from_captioning(folder: str) -> set[str]:
    """What the modules of ``folder`` (``data_prep/``) import of the ``captioning`` package (page names)."""
    from tests.harness.source import MODULES, imports

    return {_doc_name(i) for m, path in MODULES.items() if _doc_name(m).startswith(folder)
            for i in imports(path) if i.startswith("captioning") and i in MODULES}


def import_claims(text: str) -> list[tuple[str, str, set[str]]]:
    """The rows of the architecture page's "Who imports whom" table: (module or folder, "is imported by" or
    "imports, of `captioning/`", the modules it names)."""
    section = text.split("## Who imports whom", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w/.]+)` (is imported by|imports, of `captioning/`) \| (.+) \|$", section, re.M)
    return [(subject, relation, set(re.findall(r"`([\w/.]+)`", names))) for subject, relation, names in rows]


def test_who_imports_whom_on_the_architecture_page_is_the_source():
    """Both ways: every module a row names imports (or is imported) as it says, and no other does."""
    claims = import_claims(open(ARCHITECTURE, encoding="utf-8").read())
    assert {(s, r) for s, r, _ in claims} >= {("data/schema.py", "is imported by"), ("data_prep/", "is imported by"),
                                              ("data_prep/", "imports, of `captioning/`")}
    for subject, relation, named in claims:
        real = _importers(subject) if relation == "is imported by" else _imported_from_captioning(subject)
        assert named == real, (f"docs/architecture.md: {subject} {relation}: the page names {sorted(named - real)} "
                               f"that do not, and not {sorted(real - named)} that do")


def test_the_claims_the_page_made_before_fail():
    """What the page said before the table (the record schema imported by the writer and the reader alone;
    data_prep sharing only the base and the record format), written as rows, is caught."""
    old = ("## Who imports whom\n\n| claim | exactly these modules |\n|---|---|\n"
           "| `data/schema.py` is imported by | `data_prep/records.py`, `data/reading.py` |\n"
           "| `data_prep/` imports, of `captioning/` | `errors.py`, `fileio.py`, `images.py`, `text.py`, `vocab.py`, "
           "`data/schema.py`, `data/prepared.py` |\n")
    claims = import_claims(old)
    assert len(claims) == 2
    assert claims[0][2] < _importers("data/schema.py")
    assert claims[1][2] < _imported_from_captioning("data_prep/")


def test_the_readme_lists_every_dependency_setup_cfg_installs():
    """The README's list of plain dependencies is setup.cfg's install_requires, by name, both ways."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"), encoding="utf-8")
    required = {re.match(r"[A-Za-z0-9_.\-]+", line.strip()).group(0).lower()
                for line in cfg["options"]["install_requires"].splitlines() if line.strip()
                and not line.strip().startswith("#")}
    text = " ".join(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().split())
    listed = re.search(r"Everything else is a plain dependency in `setup.cfg`: ([^.]+)\.", text)
    assert listed, "README.md: the sentence that lists the dependencies"
    assert {name.strip().lower() for name in listed.group(1).split(",")} == required
    assert {"numpy", "grpcio", "google-crc32c"} <= required


def test_the_demo_training_time_is_one_measured_figure():
    """The README and experiments/shapes.yaml give the demo's training time as the same measured figure,
    never "about N minutes"."""
    readme = " ".join(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().split())
    shapes = open(os.path.join(REPO, "experiments", "shapes.yaml"), encoding="utf-8").read()
    figure = re.search(r"trains `experiments/shapes.yaml` into `runs/demo/model/` \((\d+ min \d+ s) ", readme).group(1)
    assert f"train this ({figure} " in shapes
    assert f"its 6,000 training steps took {figure} " in readme
    assert not re.search(r"about \d+ minutes", readme + shapes)


def test_the_meshed_memory_ensemble_is_said_to_average_log_probabilities():
    """The meshed-memory Transformer's TransformerEnsemble averages its members' log-softmax outputs
    (``torch.mean`` of ``log_softmax``): every sentence of the docs and of model/ensemble.py that names it
    says so, and none says it averages probabilities as self-critical.pytorch's AttEnsemble does."""
    sources = DOCS + [os.path.join(REPO, "captioning", "model", "ensemble.py")]
    sentences = [sentence for path in sources
                 for sentence in re.split(r"(?<=[.;])\s", " ".join(open(path, encoding="utf-8").read().split()))
                 if "TransformerEnsemble" in sentence]
    assert len(sentences) >= 2
    for sentence in sentences:
        assert re.search(r"log-softmax|log-probabilities", sentence), sentence
        assert "AttEnsemble` and the meshed-memory" not in sentence and "AttEnsemble`` and the meshed" not in sentence


def shown_commands():
    """(file, command line) of every `captioning ...` command in a code block of the README and the docs
    (a prompt like ``data0$`` and environment assignments in front are dropped; ``\\`` continues a line)."""
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"^\s*(\S+\$\s+)?", "", line).split("  #")[0].strip()
                line = re.sub(r"^(\w+='[^']*'\s+|\w+=\S+\s+)+", "", line)
                if line.startswith("captioning ") and not any(c in line for c in ("...", "<", "[")):  # not a synopsis
                    yield os.path.relpath(path, REPO), line


COMMANDS = sorted(set(shown_commands()))


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20 and {c.split()[1] for _, c in COMMANDS} >= {
        "synth", "prepare", "train", "evaluate", "caption", "export", "benchmark", "data-service"}


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_a_command_the_docs_show_parses_and_its_config_exists(where, command):
    from captioning import model as model_lib
    from captioning.cli import build_parser
    from captioning.config import all_keys
    from captioning.train import objectives

    argv = shlex.split(command)[1:]
    args = build_parser().parse_args(argv)  # argparse exits 2 on an unknown flag or a bad value
    config = getattr(args, "config", None)
    if config:
        assert os.path.exists(os.path.join(REPO, config)), f"{where}: {command}: no {config}"
    keys = set(all_keys()) | set(model_lib.all_keys()) | set(objectives.all_keys())
    for override in getattr(args, "overrides", []):
        key = override.partition("=")[0]
        assert key in keys, f"{where}: {command}: --set {key} is not a config key"


def test_every_code_fence_is_closed_by_a_line_of_its_own():
    """A closing ``` with text after it does not close a fence in Markdown (the rest of the page would be
    code): every fence opens and closes on lines of their own, in pairs."""
    for path in DOCS:
        fences = [(n, line) for n, line in enumerate(open(path, encoding="utf-8"), 1) if "```" in line]
        for k, (n, line) in enumerate(fences):
            closing = k % 2 == 1
            assert line.lstrip().startswith("```") and (not closing or line.strip() == "```"), \
                f"{os.path.relpath(path, REPO)}:{n}: {line.strip()!r}"
        assert len(fences) % 2 == 0, os.path.relpath(path, REPO)


def bound_rows():
    """(names, bound) of each row of docs/reliability.md's "Upper bounds of sizes" table."""
    text = open(os.path.join(REPO, "docs", "reliability.md"), encoding="utf-8").read()
    table = text.split("## Upper bounds of sizes", 1)[1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and re.fullmatch(r"[\d,]+", cells[1]):
            yield re.findall(r"`([^`]+)`", cells[0]), int(cells[1].replace(",", ""))


def test_the_upper_bounds_table_is_the_code():
    """Every bound docs/reliability.md gives is the code's: a config key's declared upper bound (each section's,
    or every decoder's that declares the key), a flag's type accepts the bound and refuses the next number."""
    import argparse
    import dataclasses

    from captioning import model as model_lib
    from captioning.cli import build_parser
    from captioning.config import COMPONENT_SECTIONS, Config
    from captioning.config.settings import keys_of
    from captioning.train.objectives import OBJECTIVES

    classes = {name: [type(getattr(Config(), name))] for name in keys_of(Config) if name not in COMPONENT_SECTIONS}
    classes |= {name: [cls.settings_class] for name, cls in OBJECTIVES.items() if cls.settings_class}
    classes["model"] += [cls.settings_class for cls in [*model_lib.DECODERS.values(), *model_lib.ENCODERS.values()]]
    rows = list(bound_rows())
    assert len(rows) > 40
    for names, bound in rows:
        for name in names:
            if re.fullmatch(r"\w+\.\w+", name):  # a config key
                section, key = name.split(".")
                found = [f.metadata["range"][2] for cls in classes[section] for f in dataclasses.fields(cls)
                         if f.name == key]
                assert found and all(high == bound for high in found), (name, found, bound)
                continue
            words = name.split()
            flag = next(w for w in words if w.startswith("--"))
            parser = build_parser()
            for word in words[:words.index(flag)]:
                parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
            action = next(a for a in parser._actions if flag in a.option_strings)
            form = "x={}" if "NAME=N" in words else "{}x8" if "WxH" in words else "{}"
            action.type(form.format(bound))
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(form.format(bound + 1))


def test_the_suites_schedule_names_test_files_and_make_keeps_its_order():
    """tests/conftest.py's FILE_SECONDS orders the files heaviest first; each name is a test file, and both of the
    Makefile's pytest runs turn off xdist's own reordering (by number of tests), which would undo it."""
    from tests.conftest import FILE_SECONDS, QUICK_SECONDS

    files = {f[:-3] for f in os.listdir(os.path.join(REPO, "tests")) if f.startswith("test_") and f.endswith(".py")}
    assert set(FILE_SECONDS) <= files, set(FILE_SECONDS) - files
    assert set(QUICK_SECONDS) <= files, set(QUICK_SECONDS) - files
    makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    assert re.search(r"^PYTEST +=.* \$\(BIN\)/python -m pytest$", makefile, re.M)
    runs = re.findall(r"^\t\$\(PYTEST\) (.*)$", makefile, re.M)
    assert len(runs) == 2 and all("--dist loadfile --no-loadscope-reorder" in run for run in runs), runs


def test_the_quick_loop_is_scheduled_by_its_own_weights():
    """With a slow test of a file selected, the file weighs its FILE_SECONDS; with only its quick tests (`-m 'not
    slow'`), its QUICK_SECONDS: test_scst, heaviest of the whole suite for its 2-replica runs, goes after
    test_encoders in the quick loop. Within a file the order stays."""
    import pathlib

    from tests.conftest import FILE_SECONDS, QUICK_SECONDS, schedule

    class Item:  # what schedule reads of a pytest item: its file and its slow mark
        def __init__(self, stem, name, slow):
            self.path, self.name, self.slow = pathlib.Path(f"tests/{stem}.py"), name, slow

        def get_closest_marker(self, name):
            return name == "slow" and self.slow or None

    assert FILE_SECONDS["test_scst"] > FILE_SECONDS["test_encoders"]
    assert QUICK_SECONDS["test_scst"] < QUICK_SECONDS["test_encoders"]
    quick = [Item("test_scst", "a", False), Item("test_encoders", "b", False), Item("test_scst", "c", False)]
    full = quick + [Item("test_scst", "d", True)]
    schedule(quick), schedule(full)
    assert [i.name for i in quick] == ["b", "a", "c"] and [i.name for i in full] == ["a", "c", "d", "b"]


def test_make_tests_workers_are_one_a_core_and_one_more_with_the_slow_tests(monkeypatch):
    """The Makefile's `-n auto` asks tests/conftest.py's hook: a core each for the quick loop (`-m 'not slow'`), one
    more when slow tests are selected (the whole suite, or `-m slow`), as many as the memory holds; pytest-xdist's own
    variable still decides."""
    from tests.conftest import pytest_xdist_auto_num_workers, workers_for

    class Config:
        def __init__(self, markexpr):
            self.markexpr = markexpr

        def getoption(self, name):
            assert name == "markexpr"
            return self.markexpr

    makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    assert re.search(r"^TEST_WORKERS \?= auto$", makefile, re.M)
    assert all("-n $(TEST_WORKERS)" in run for run in re.findall(r"^\t\$\(PYTEST\) (.*)$", makefile, re.M))
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert [pytest_xdist_auto_num_workers(Config(m)) for m in ("", "slow", "not slow", "not slow and not docs")] \
        == [cores + 1, cores + 1, cores, cores]
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert pytest_xdist_auto_num_workers(Config("")) is None  # pytest-xdist's own hook answers
    # and memory bounds them: 64 cores and 24 GiB start 8 workers, a machine of 2 GiB one
    assert [workers_for(64, 24 * 2**30, True), workers_for(2, 24 * 2**30, True), workers_for(2, 2**31, False)] \
        == [8, 3, 1]


def test_the_cpu_log_counts_a_tests_own_cpu_and_its_childrens(request, monkeypatch, tmp_path):
    """``--cpu-log FILE`` (tests/conftest.py, docs/reliability.md): the hook around a test, driven here around
    this test's own item, appends one line with the CPU seconds spent in this process and in a child it waited
    for, each counted where it was spent."""
    import subprocess
    import sys
    import time

    from tests import conftest

    log = tmp_path / "runs" / "cpu.tsv"  # in a folder that is not there yet
    monkeypatch.setattr(request.config.option, "cpu_log", str(log))
    for burn in (True, False):  # a second test's line goes after the first's
        hook = conftest.pytest_runtest_protocol(request.node, None)
        next(hook)
        if burn:
            start = time.process_time()
            while time.process_time() - start < 0.3:  # 0.3 s of CPU here
                pass
            subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() "
                            "- t < 1.0: pass"], check=True)  # 1 s in a child
        with pytest.raises(StopIteration):
            hook.send(None)
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert [(node, worker) for node, *_, worker in lines] == [
        (request.node.nodeid, os.environ.get("PYTEST_XDIST_WORKER", "-"))] * 2
    (own, children, wall), (_, later, _) = ([float(x) for x in line[1:4]] for line in lines)
    assert 0.3 <= own < 1.0 and 1.0 <= children < 1.5 and wall >= 1.3 and later == 0.0
    monkeypatch.setattr(request.config.option, "cpu_log", None)  # without the option: nothing is written
    hook = conftest.pytest_runtest_protocol(request.node, None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(None)
    assert len(log.read_text().splitlines()) == 2


def test_the_test_modules_rewritten_before_the_workers_start_are_what_pytest_reads(tmp_path):
    """tests/rewrite_cache.py (run by the Makefile before pytest's workers start) writes each module's
    assertion-rewritten bytecode where pytest reads it, under PYTHONDONTWRITEBYTECODE too; a rerun writes nothing.
    The proof that pytest reads that very file: the cached code of a module whose source fails is swapped for a
    passing one's, and pytest then passes it."""
    import importlib.util
    import subprocess
    import sys

    from _pytest.assertion import rewrite

    from tests import rewrite_cache

    source = tmp_path / "test_sample.py"
    source.write_text("def test_it():\n    x = [1, 2]\n    assert len(x) == 3\n")
    assert rewrite_cache.main(str(tmp_path)) == 0
    pyc = tmp_path / "__pycache__" / f"test_sample.{rewrite.PYTEST_TAG}.pyc"
    code = rewrite._read_pyc(source, pyc)  # pytest's own reader accepts it for this source
    assert code is not None and "@pytest_ar" in code.co_names  # the assertions rewritten
    written = pyc.stat().st_mtime_ns
    assert rewrite_cache.main(str(tmp_path)) == 0 and pyc.stat().st_mtime_ns == written

    other = tmp_path / "other" / "test_sample.py"
    other.parent.mkdir()
    other.write_text(source.read_text().replace("== 3", "== 2"))
    _, passing = rewrite._rewrite_test(other, None)
    rewrite._write_pyc(None, passing, importlib.util.source_hash(source.read_bytes()), pyc)  # as for the source
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source)], cwd=tmp_path,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:]
