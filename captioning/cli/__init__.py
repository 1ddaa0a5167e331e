"""The ``captioning`` command line: one subcommand per stage of the data's path.

::

    captioning synth      a synthetic dataset, shapes or hard scenes (COCO)  data_prep.synth
    captioning prepare    COCO / Karpathy / TFDS → sharded TFRecords        data_prep.prepare
    captioning train      an experiment config → a model folder             captioning.train
    captioning evaluate   perplexity and COCO metrics of a model on a split captioning.evaluation.evaluate
    captioning score      a COCO results file against annotations           captioning.evaluation.metrics
    captioning caption    captions (and a gallery) for your images          captioning.inference.caption
    captioning export     a SavedModel that captions encoded images         captioning.inference.export
    captioning serve      a web page and a JSON API that caption images     captioning.inference.serve
    captioning features   region features beside a prepared dataset        data_prep.features_import
    captioning benchmark  input, train, decode, prepare against ceilings    captioning.benchmarks
    captioning data-service  a tf.data service dispatcher or worker        captioning.data.service
    captioning lm train   a language model and tokenizer → a preset folder  captioning.train.language_model
    captioning clip train a CLIP of a prepared split → a preset folder     captioning.train.contrastive

This package is the only code that wires stages together (``data_prep`` included). Flags live in
:mod:`.commands`, :mod:`.export`, :mod:`.serve`, :mod:`.features`, :mod:`.benchmark`, :mod:`.data_service` and
:mod:`.lm`, :mod:`.clip`,
shared parsing in :mod:`.parsing`.

Exit codes: 0 success; 1 finished with errors on some inputs (``train``: a non-finite loss under
``train.nan_policy: stop``); 2 usage or input error (one line on stderr, no traceback; a library error
naming a parameter is printed naming its flag); 130 interrupted. ``train`` catches SIGINT and SIGTERM
itself: it finishes the step, saves a checkpoint and exits 0 (before its first step, waiting for a tf.data
dispatcher, it says so in one line and exits 0); ``data-service`` servers stop and exit 0.

A ``--config`` file (with its ``--set`` overrides) is read and checked here, before TensorFlow is imported
(about 2 s): a wrong key, type or value is one line at once. The handlers import their stage when they run.
"""

from __future__ import annotations

import logging
import os
import sys

from captioning import __version__
from captioning.cli import commands
from captioning.cli.benchmark import add_benchmark
from captioning.cli.clip import add_clip
from captioning.cli.data_service import add_data_service
from captioning.cli.export import add_export
from captioning.cli.features import add_features
from captioning.cli.lm import add_lm
from captioning.cli.parsing import Parser
from captioning.cli.serve import add_serve
from captioning.errors import InputError, PeerLostError

log = logging.getLogger("captioning")

_USES_TENSORFLOW = {"train", "evaluate", "caption", "export", "benchmark", "features", "serve", "lm", "clip"}


def build_parser() -> Parser:
    parser = Parser(prog="captioning", description="Show-and-Tell image captioning on TensorFlow 2: prepare "
                                                   "data, train, evaluate, caption.")
    parser.add_argument("--version", action="version", version=f"captioning {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, TensorFlow's included")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (commands.add_synth, commands.add_prepare, commands.add_train, commands.add_evaluate,
                commands.add_score, commands.add_caption, add_export, add_serve, add_features, add_benchmark,
                add_data_service, add_lm, add_clip):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:  # TensorFlow's C++ logs of its internals (captioning.tf_import), before it is first imported
        from captioning.tf_import import CPP_LOG_LEVEL, quiet_python_logs

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", CPP_LOG_LEVEL)
        quiet_python_logs()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    if not args.verbose:  # TensorFlow's own Python logger narrates internals (checkpoint sharding, ...)
        logging.getLogger("tensorflow").setLevel(logging.WARNING)
        logging.getLogger("absl").setLevel(logging.WARNING)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        if getattr(args, "config", None):  # the config's errors (keys, types, ranges) before TensorFlow loads
            from captioning.config import load_config

            args.loaded_config = load_config(args.config, getattr(args, "overrides", ()))
        # prepare needs TensorFlow only for a TFDS source (its workers never do): imported here, quietly
        if not args.verbose and (args.command in _USES_TENSORFLOW or getattr(args, "tfds", None)):
            from captioning.tf_import import import_tensorflow_quietly

            import_tensorflow_quietly()
        with logging_redirect_tqdm():  # log lines print above progress bars, not through them
            return args.handler(args)
    except InputError as e:
        message = e.for_flags(args.flags())  # the flags of the (sub)command run
        print(f"captioning {args.command}: error: {message}", file=sys.stderr)
        if isinstance(e, PeerLostError):
            # TF's coordination agent, shut down in an error state, logs that state from C++ at exit,
            # after this line: the line above says it all, so stderr ends here (exit itself stays normal).
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        return e.exit_code
    except Exception as e:  # a full disk wherever it strikes (a log, a summary): one line, not a traceback
        from captioning.fileio import disk_full_error

        error = disk_full_error(e, getattr(e, "filename", None) or "the disk", "an output")
        if error is None:
            raise
        print(f"captioning {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"captioning {args.command}: interrupted", file=sys.stderr)
        return 130
