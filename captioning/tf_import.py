"""Importing TensorFlow without its C++ start-up chatter.

TensorFlow 2.21 prints lines such as "All log messages before absl::InitializeLog() is called are
written to STDERR" and "oneDNN custom operations are on" from C++ while it is imported, before
``TF_CPP_MIN_LOG_LEVEL`` or any Python logging setting can apply, and the `tensorflow` wheel's first look for
CUDA prints "failed call to cuInit" on a machine without a GPU driver. The command line imports it once, and
lists the devices, with
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
        import tensorflow

        # The `tensorflow` wheel (not tensorflow-cpu) probes CUDA when it first lists devices: on a machine without
        # a GPU driver that is one more C++ error line ("failed call to cuInit"). Listing the physical devices here
        # does it while stderr is away; it does not start the runtime (logical devices can still be configured).
        tensorflow.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
