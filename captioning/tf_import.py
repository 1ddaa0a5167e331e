"""Importing TensorFlow without its C++ start-up chatter.

TensorFlow 2.21 prints lines such as "All log messages before absl::InitializeLog() is called are
written to STDERR" and "oneDNN custom operations are on" from C++ while it is imported, before
``TF_CPP_MIN_LOG_LEVEL`` or any Python logging setting can apply. The command line imports it once with
file descriptor 2 pointed at /dev/null, so its logs say what the program is doing; ``-v`` keeps
everything. A failing import still raises its Python exception after stderr is restored.
"""

from __future__ import annotations

import os
import sys


def import_tensorflow_quietly() -> None:
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(devnull, 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
