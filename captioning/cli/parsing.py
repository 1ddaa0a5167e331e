"""Argument parsing shared by the commands: one-line usage errors, checked numbers, the flags several
commands share (``--config``/``--set``, the decoding flags), and the bridge from parsed flags to
library calls.

The library takes parameters, not flags. Two helpers pass them on without copying fields by hand:
:func:`options` builds an options dataclass (``PrepareOptions``) from the flags of the same names, and
:func:`call` calls a function with the flags its signature names. Each flag's ``dest`` is its parameter's
name (``--min-word-count`` → ``min_word_count``), and :meth:`Parser.flag_names` maps them back, which
is how an :class:`~captioning.errors.InputError` naming ``min_word_count`` is printed as naming
``--min-word-count``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``captioning evaluate: error: argument --batch-size: must be
    an integer in [1, 1,024], got 0 (see captioning evaluate --help)`` and exit code 2; the line names
    the command as every other error line does (``captioning benchmark: error: …`` for its subcommands).
    It records each flag's parameter name (:meth:`flag_names`)."""

    def __init__(self, *args, **kwargs):
        self._flags: dict[str, str] = {}  # before argparse adds --help
        super().__init__(*args, **kwargs)
        # parsed arguments carry the flag names of the innermost (sub)parser that parsed them
        self.set_defaults(flags=self.flag_names)

    def add_argument(self, *names, **kwargs):
        action = super().add_argument(*names, **kwargs)
        self._note(action)
        return action

    def _note(self, action) -> None:
        long = [o for o in action.option_strings if o.startswith("--")]
        if long:
            self._flags.setdefault(action.dest, long[0])

    def add_argument_group(self, *args, **kwargs):
        return self._noting(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, *args, **kwargs):
        return self._noting(super().add_mutually_exclusive_group(*args, **kwargs))

    def _noting(self, group):
        add = group.add_argument

        def add_argument(*names, **kw):  # flags of a group are flags of this parser
            action = add(*names, **kw)
            self._note(action)
            return action

        group.add_argument = add_argument
        return group

    def flag_names(self) -> dict[str, str]:
        """Parameter name → flag, e.g. ``{"min_word_count": "--min-word-count", "overrides": "--set"}``."""
        return dict(self._flags)

    def error(self, message: str):
        command = " ".join(self.prog.split()[:2])  # "captioning benchmark", as every other error line says
        self.exit(2, f"{command}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


# The upper bounds of the sizes the flags take (docs/reliability.md, "Upper bounds of sizes"; the decoding sizes
# and the config's are captioning.config.settings' MAX_*, the features commands' captioning.cli.features'): generous for
# research use, they stop an absurd value in one line before any work starts.
MAX_SEED = 2**32 - 1  # numpy's seeds
MAX_WORKERS = 256  # processes or servers started on one machine
MAX_SIDE = 16_384  # pixels of an image's side (a decoded 16384 x 16384 image is 1 GiB)
MAX_ROUNDS = 100  # a benchmark's repeated measurements
MAX_SHARDS = 100_000  # shards of one split
MAX_IMAGES_PER_SHARD = 100_000
MAX_SYNTH_IMAGES = 1_000_000  # synth's images (about 10 KB of JPEG each)
MAX_BENCHMARK_IMAGES = 100_000  # photos a benchmark makes and reads
MAX_BENCHMARK_STEPS = 1_000_000  # steps a benchmark times
MAX_SPLIT_IMAGES = 10_000_000  # evaluate --max-images (a cap: COCO's splits have 5,000 to 123,287)
MAX_WORD_COUNT = 1_000_000  # prepare --min-word-count
MAX_CIDER = 100.0  # benchmark quality --target


def _number(x) -> str:
    """A bound as it is written: an integral one as an integer with thousands separators (``4,294,967,295``).

    >>> _number(2**32 - 1), _number(86400.0), _number(0.1)
    ('4,294,967,295', '86,400', '0.1')
    """
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def within(low, high, kind=int):
    """An argparse type: an integer (or, with ``kind=float``, a finite number) in ``[low, high]``, the
    documented bounds of a size a user types (checked before any work starts). Every number a flag takes has
    one (tests/test_cli.py checks each flag of the command line with a huge value)."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {what} in [{_number(low)}, {_number(high)}], got {text}")
        return value

    parse.__name__ = f"{what} in [{low:g}, {high:g}]"
    return parse


def key_int(low: int, high: int):
    """An argparse type: ``NAME=INTEGER`` (``--shards train=256``), the integer in ``[low, high]``."""
    def parse(text: str) -> tuple[str, int]:
        name, eq, value = text.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = None
        if not eq or not name or number is None:
            raise argparse.ArgumentTypeError(f"{text!r} must look like NAME=INTEGER, e.g. train=256")
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: the integer must be in [{_number(low)}, {_number(high)}]")
        return name, number

    parse.__name__ = "NAME=INTEGER"
    return parse


def size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT``, each at least 8 and at most :data:`MAX_SIDE`."""
    width, x, height = text.lower().partition("x")
    if (not x or not width.isdigit() or not height.isdigit() or not 8 <= int(width) <= MAX_SIDE
            or not 8 <= int(height) <= MAX_SIDE):
        raise argparse.ArgumentTypeError(f"{text!r} must look like WIDTHxHEIGHT, e.g. 640x480 (each side in "
                                         f"[8, {_number(MAX_SIDE)}])")
    return int(width), int(height)


def config_flags(p, required: bool = True, help: str | None = None) -> None:
    """``--config FILE`` and the repeatable ``--set SECTION.KEY=VALUE`` (dest ``overrides``)."""
    p.add_argument("--config", required=required,
                   help=help or "experiment YAML (may inherit from another with base:)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key, parsed by its type (repeatable), e.g. train.steps=500")


def decoding_flags(p, top_k: bool = False, sets: bool = True) -> None:
    """The flags that override the model's ``decode:`` config for one call (default None: the config's
    value; the defaults themselves live in :class:`captioning.config.sections.DecodeConfig` alone, and so do
    the sizes' upper bounds)."""
    from captioning.config.settings import MAX_BEAM, MAX_LENGTH_NORMALIZATION, MAX_WORDS

    p.add_argument("--beam-size", type=within(1, MAX_BEAM), default=None,
                   help=f"beam width, at most {MAX_BEAM}; 1 is greedy decoding (default: the model's decode.beam_size, 3)")
    p.add_argument("--max-length", type=within(1, MAX_WORDS), default=None,
                   help=f"longest caption in words, at most {MAX_WORDS} (default: the model's decode.max_length, 20)")
    p.add_argument("--length-normalization", type=within(0, MAX_LENGTH_NORMALIZATION, float), default=None,
                   metavar="ALPHA", help=f"rank complete captions by log_prob / length^ALPHA, ALPHA at most "
                                         f"{MAX_LENGTH_NORMALIZATION:g} (default: the model's "
                                         "decode.length_normalization, 0: by log_prob)")
    if top_k:
        p.add_argument("--top-k", type=within(1, MAX_BEAM), default=None,
                       help="captions per image, best first, at most --beam-size (default: decode.top_k, 1)")
    if sets:
        p.add_argument("--set", action="append", default=[], metavar="decode.KEY=VALUE", dest="decode_overrides",
                       help="override one decode: key for this call (repeatable), e.g. decode.method=sample, "
                            "decode.block_ngrams=3, decode.length_penalty=gnmt")


def options(cls, args: argparse.Namespace, **values):
    """An instance of the dataclass ``cls`` from the flags named as its fields (``values`` first)."""
    given = vars(args)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: values[name] if name in values else given[name] for name in fields
                  if name in values or name in given})


def call(function, args: argparse.Namespace, **values):
    """``function`` called with the flags its signature names (``values`` first)."""
    given = vars(args)
    names = inspect.signature(function).parameters
    return function(**{name: values[name] if name in values else given[name] for name in names
                       if name in values or name in given})


MAX_BATCH_WAIT_MS = 1000  # --batch-wait-ms: a second is already far more than batching needs


def batching_flags(p) -> None:
    """``--max-batch`` and ``--batch-wait-ms``: how ``captioning serve`` batches concurrent requests (its own
    flags, and ``benchmark serve``'s for the server it starts)."""
    from captioning.config.settings import MAX_DECODE_BATCH

    p.add_argument("--max-batch", type=within(1, MAX_DECODE_BATCH), default=16,
                   help=f"most images captioned in one model call, at most {MAX_DECODE_BATCH:,} (default 16)")
    p.add_argument("--batch-wait-ms", type=within(0, MAX_BATCH_WAIT_MS, float), default=5.0,
                   help="how long a model call waits for more images to fill its batch, in milliseconds, at most "
                        f"{MAX_BATCH_WAIT_MS:,} (default 5)")
