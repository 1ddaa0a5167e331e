"""Writes pytest's assertion-rewritten bytecode of the test modules once, before `make test` starts its workers.

pytest rewrites every ``assert`` of a test module when it imports it, and keeps the result beside the source
(``tests/__pycache__/test_x.cpython-311-pytest-9.2.0.pyc``) only where Python may write bytecode. CI sets
``PYTHONDONTWRITEBYTECODE``, so each pytest-xdist worker rewrote every module of tests/ (66) again while collecting:
collecting the suite took 13.3-14.8 CPU s a process without that cache and 6.3 s with it (2 cores, 2026-11-26),
in each of the three workers. This writes the cache in one process, in 2.3 CPU s (without building a pytest config); the Makefile then lets pytest
write what else it rewrites (the plugins' modules).

    python tests/rewrite_cache.py [FOLDER]   # tests/ by default; before `pytest -n 3`; a rerun writes nothing

It uses pytest's own rewriting, from a private module (``_pytest.assertion.rewrite``), so that what the
workers read is exactly what they would have written: if that module changes, this writes nothing and says so,
and the suite runs as before, only slower.
"""

import glob
import os
import sys
from pathlib import Path


def main(folder: str) -> int:
    """Writes the rewritten bytecode of every ``*.py`` of ``folder`` that has none for its present source; 0."""
    try:
        from _pytest.assertion import rewrite

        for source in sorted(glob.glob(os.path.join(folder, "*.py"))):
            path = Path(source)
            pyc = rewrite.get_cache_dir(path) / f"{path.stem}.{rewrite.PYTEST_TAG}.pyc"
            if rewrite._read_pyc(path, pyc) is not None:  # already there, for this source
                continue
            # no config: pytest's defaults, as setup.cfg leaves them (the one setting the rewriting reads,
            # enable_assertion_pass_hook, is off), so the code is what the workers' own rewriting gives
            source_hash, code = rewrite._rewrite_test(path, None)
            pyc.parent.mkdir(exist_ok=True)
            rewrite._write_pyc(None, code, source_hash, pyc)
    except Exception as e:  # noqa: BLE001 - a speed-up only: the workers rewrite the modules themselves
        print(f"tests/rewrite_cache.py: stopped ({type(e).__name__}: {e}); each worker rewrites the tests",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))))
