"""No code path can construct arbitrary Python objects from a file: configs are read with
``yaml.safe_load`` only, and nothing unpickles (a scan of the sources, so a new module is covered)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNSAFE = [
    (re.compile(r"^\s*(import|from)\s+(c?[pP]ickle|_pickle|dill|shelve|marshal)\b", re.M), "unpickling module"),
    (re.compile(r"\byaml\.(load|unsafe_load|full_load|load_all)\s*\("), "yaml loader other than safe_load"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle"),
    (re.compile(r"\b(eval|exec)\s*\("), "eval/exec"),
]


def test_no_unsafe_deserialisation_in_the_sources():
    sources = sorted((ROOT / "captioning").rglob("*.py")) + sorted((ROOT / "data_prep").rglob("*.py"))
    assert len(sources) > 20
    found = [f"{path.relative_to(ROOT)}: {what}" for path in sources for pattern, what in UNSAFE
             if pattern.search(path.read_text(encoding="utf-8"))]
    assert not found, found


def test_the_scan_catches_what_it_looks_for():
    samples = ["import pickle\n", "from cPickle import loads\n", "yaml.load(f)", "np.load(p, allow_pickle=True)",
               "eval(text)"]
    assert all(any(p.search(s) for p, _ in UNSAFE) for s in samples)
    assert not any(p.search("yaml.safe_load(f)") for p, _ in UNSAFE)
