"""Importing TensorFlow without its C++ chatter, and keeping its internals out of the user's log.

TensorFlow 2.21 prints lines such as "All log messages before absl::InitializeLog() is called are
written to STDERR" and "oneDNN custom operations are on" from C++ while it is imported, before
``TF_CPP_MIN_LOG_LEVEL`` or any Python logging setting can apply, and the `tensorflow` wheel's first look for
CUDA prints "failed call to cuInit" on a machine without a GPU driver. The command line imports it once, and
lists the devices, with
file descriptor 2 pointed at /dev/null, so its logs say what the program is doing; ``-v`` keeps
everything. A failing import still raises its Python exception after stderr is restored.

Later, while graphs are optimised and run, its C++ code logs at ERROR level what is no error of the user's
("E0000 … util.cc] oneDNN supports DT_UINT8 only on platforms with AVX-512. Falling back to …", "E0000 …
meta_optimizer.cc] layout failed: …", a graph optimisation skipped): ``TF_CPP_MIN_LOG_LEVEL`` is 3 (C++ fatal
messages only) unless the environment sets it or ``-v`` is given. A real failure still reaches the user: an
op's error is raised in Python, and the command prints it in one line or a traceback. Its Python logger's
"N out of the last M calls to <function> triggered tf.function retracing" warnings (a new decoding setting
traces anew, by design) are dropped by :func:`quiet_python_logs`.
"""

from __future__ import annotations

import logging
import os
import sys

CPP_LOG_LEVEL = "3"  # TF_CPP_MIN_LOG_LEVEL: 0 all, 1 no INFO, 2 no WARNING, 3 no ERROR (FATAL only)


class _NoRetracingWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


def quiet_python_logs() -> None:
    """TensorFlow's Python logger keeps its warnings except the retracing ones (see the module docstring);
    once per process, before or after TensorFlow is imported."""
    logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, _NoRetracingWarnings) for f in logger.filters):
        logger.addFilter(_NoRetracingWarnings())


def import_tensorflow_quietly() -> None:
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", CPP_LOG_LEVEL)
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
