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
    order = re.search(r"`data`\s+→\s+`model`\s+→\s+`train`\s+→\s+`inference`\s+→\s+`evaluation`\s+→\s+"
                      r"`benchmarks`\s+→\s+`cli`", text)
    assert order and tuple(re.findall(r"`(\w+)`", order.group(0))) == captioning.STAGES


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

    argv = shlex.split(command)[1:]
    args = build_parser().parse_args(argv)  # argparse exits 2 on an unknown flag or a bad value
    config = getattr(args, "config", None)
    if config:
        assert os.path.exists(os.path.join(REPO, config)), f"{where}: {command}: no {config}"
    keys = set(all_keys()) | set(model_lib.all_keys())
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
