"""Settings: how a config section declares its keys, and the one engine that types and checks their values.

A section is a dataclass (:class:`Section`): its fields are its keys, each with its default, its type
(``bool``, ``int``, ``float``, ``str``, a list of integers or of words), and in the field's metadata its
choices (:func:`choices`) or its range (:func:`between`, :func:`at_least`, :func:`more_than`); its
``check()`` holds the rules between its own keys. Every number has a range, with an upper bound for
sizes and counts (the ``MAX_*`` constants below: docs/reliability.md, "Upper bounds of sizes").

:func:`section_from` makes an instance of such a dataclass from ``{name: value}``, each value converted
and checked as its field declares: the config loader (:mod:`captioning.config`) reads the shared
sections with it, and a component reads its own settings with it — a decoder its ``model.*`` keys
(``captioning.model.resolve``), a training objective its section (``captioning.train.objectives.resolve``:
``scst:``) — so a key means the same, and is refused with the same one-line
:class:`~captioning.errors.InputError`, wherever it is declared. A value given as text (``--set
section.key=value``) is a :class:`Given` until the section's type for it is known.

This module imports nothing of the project but its errors: every stage may declare settings with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass

import yaml

from captioning.errors import InputError, excerpt

_INT64 = range(-2**63, 2**63)  # what TensorFlow can hold; a larger int is refused here, not deep in a run
SEED = range(0, 2**31)  # seeds reach int32 ops (stateless sampling) and numpy's generator
# The largest decoding sizes (decode:, and the flags --beam-size, --max-length, --top-k): what one decoding
# holds grows with images x beams x words, and a Transformer keeps ~1.4 MB a row for 20 words (measured: d_model
# 512, 6 layers, a 10,000-word vocabulary), so 32 images (evaluate's batch) x 50 beams x 100 words stays within a
# few GiB; beam 100,000 was killed for memory with no message. Papers decode with beams of 3 to 20.
MAX_BEAM = 50  # decode.beam_size, decode.beam_groups, decode.top_k (captions per image, sampled ones too)
MAX_WORDS = 100  # decode.max_length, decode.block_ngrams
MAX_SAMPLE_TOP_K = 100_000  # decode.sample_top_k (beyond the vocabulary it keeps every word)
MAX_DECODE_BATCH = 1024  # images decoded together (evaluate --batch-size, benchmark decode --batch-size)
# The upper bounds of every other size and count a config holds (docs/reliability.md, "Upper bounds of sizes"):
# generous for research use, they stop an absurd value (a typo's extra zeros) in one line before any work.
# Each bounds one setting; a product of settings (batch x words x width) can still exceed memory.
MAX_IMAGE_SIZE = 1024  # data.image_size, in pixels (Inception v3 reads 299, ViTs 224 to 518)
MAX_RESIZE_SIZE = 2048  # data.resize_size, in pixels
MAX_BATCH = 8192  # train.batch_size (global), data.parse_batch_size
MAX_STEPS = 10**9  # train.steps and every count of steps
MAX_STEPS_PER_EXECUTION = 10_000  # train.steps_per_execution
MAX_ACCUMULATE_STEPS = 1024  # train.accumulate_steps (micro-batches per optimizer step)
MAX_EVAL_BATCHES = 100_000  # train.eval_batches
MAX_KEPT_CHECKPOINTS = 1000  # train.keep_checkpoints (each holds the model and its optimizer)
MAX_EPOCHS = 1e6  # train.lr_decay_epochs
MAX_GRADIENT_NORM = 1e6  # train.clip_gradient_norm
MAX_SHUFFLE_BUFFER = 200_000  # data.shuffle_buffer: a whole COCO train split (113,287 images) fits
MAX_LENGTH_WINDOW = 1024  # data.length_window, in batches
MAX_GROUP_CAPTIONS = 100  # data.group_captions, per image (COCO has 5 to 7)
MAX_SECONDS = 86_400  # timeouts: a day
MAX_WIDTH = 8192  # a decoder's widths (embeddings, LSTM units, attention, d_model; a feed-forward block 4x)
MAX_FEATURE_SIZE = 65_536  # model.region_feature_size (detectors give 2,048; training sets it from the store)
MAX_REGION_PAD_MULTIPLE = 1024  # data.region_pad_multiple (a store holds tens to a few hundred regions an image)
MAX_INIT_SCALE = 10.0  # a decoder's init_scale (kernels start uniform in +-init_scale; 0.08 in the papers)
MAX_LAYERS = 48  # a Transformer's layers, each stack
MAX_HEADS = 64  # attention heads
MAX_POSITIONS = 1024  # model.max_positions (a caption decodes at most MAX_WORDS words)
MAX_CPUS = 256  # distribute.logical_cpus
MAX_FACTOR = 1000.0  # the weights of the loss's terms and penalties (weight_decay, attention_l1, diversity)
MAX_TEMPERATURE = 100.0  # sampling temperatures
MAX_LENGTH_NORMALIZATION = 10.0  # decode.length_normalization, an exponent (0.6 to 1 in papers)


def choices(*values: str) -> dict:
    """Field metadata: the values a string key may take."""
    return {"choices": values}


def at_least(low: float) -> dict:
    """Field metadata: a number ``>= low``."""
    return {"range": (low, False, None, False)}


def more_than(low: float) -> dict:
    """Field metadata: a number ``> low``."""
    return {"range": (low, True, None, False)}


def between(low: float, high: float, high_open: bool = False, low_open: bool = False) -> dict:
    """Field metadata: a number in ``[low, high]`` (``high_open``: ``< high``; ``low_open``: ``> low``)."""
    return {"range": (low, low_open, high, high_open)}


def _bound(x) -> str:
    """A bound as it is written: an integral one as an integer (``2147483647``, never ``2.14748e+09``).

    >>> _bound(2**31 - 1), _bound(0.0), _bound(0.5), _bound(1e-4)
    ('2147483647', '0', '0.5', '0.0001')
    """
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else f"{x:g}"


def describe_range(bounds) -> str:
    """``at least 1``, ``more than 0`` or ``in [0, 1)``; integral bounds as integers.

    >>> describe_range(between(0, 2**31 - 1)["range"]), describe_range(more_than(0.0)["range"])
    ('in [0, 2147483647]', 'more than 0')
    """
    low, low_open, high, high_open = bounds
    if high is None:
        return f"{'more than' if low_open else 'at least'} {_bound(low)}"
    return f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"


def closed_range(bounds, kind: type = float) -> tuple:
    """The smallest and largest values of ``kind`` inside ``bounds``: an open end moved to the nearest value
    inside (the next integer, the next float), as an HTML input's inclusive ``min`` and ``max`` need.

    >>> closed_range(more_than(0.0)["range"]), closed_range(between(0, 10, low_open=True)["range"], int)
    ((5e-324, None), (1, 10))
    """
    low, low_open, high, high_open = bounds
    step = (lambda x, to: x + (1 if to > x else -1)) if kind is int else math.nextafter
    return (step(low, math.inf) if low is not None and low_open else low,
            step(high, -math.inf) if high is not None and high_open else high)


def in_range(value: float, bounds) -> bool:
    low, low_open, high, high_open = bounds
    above = value > low if low_open else value >= low
    below = high is None or (value < high if high_open else value <= high)
    return above and below


class Section:
    """What every config section is: a dataclass of keys (see the module docstring) that checks the
    rules between its own keys in :meth:`check`, naming them with ``prefix`` (``"train."``)."""

    def check(self, prefix: str) -> None:
        """InputError when keys of this section contradict each other (none by default)."""


@dataclass(frozen=True)
class Given:
    """A component's setting as ``--set`` gave it (a decoder's ``model.lstm_units``, an objective's
    ``scst.samples``): text, parsed once the component's type for it is known (the same rules as every
    key's ``--set`` text)."""

    text: str

    def literal(self):
        """The value YAML would read from the text (``16`` → 16), what a config file written before the
        component typed it holds: it loads back as the same setting."""
        try:
            value = yaml.safe_load(self.text)
        except yaml.YAMLError:
            return self.text
        return value if isinstance(value, (bool, int, float, list)) and not (
            isinstance(value, float) and not math.isfinite(value)) else self.text


@functools.lru_cache(maxsize=None)
def type_hints(cls) -> typing.Mapping[str, typing.Any]:
    """``typing.get_type_hints(cls)``, read-only, worked out once a class: it evaluates every annotation (they are
    strings here), and loading a complete config asks it for every key (a model folder's config.yaml loaded in
    about a fifth of the time)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


# the metadata of a dataclass field that is no config key (what a section holds besides its keys: the
# components' settings as given and as typed, where each key's value came from)
NOT_A_KEY = {"key": False}


def fields_of(cls) -> dict[str, dataclasses.Field]:
    """The keys of a section dataclass, ``{name: field}``: its fields but those marked :data:`NOT_A_KEY`
    (``ModelConfig``'s ``options``, which hold the components' keys as given, and their typed settings)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("key", True)}


def keys_of(cls) -> list[str]:
    """The keys of a section dataclass (:func:`fields_of`'s names)."""
    return list(fields_of(cls))


def unknown_key(key: str, known: typing.Sequence[str]) -> InputError:
    """The error for ``key`` (``"scst.samplez"``), which no section declares: the nearest of the ``known``
    keys (``section.name``) when some are close, else those of its section.

    >>> str(unknown_key("scst.samplez", ["scst.samples", "train.steps"]))
    "unknown config key 'scst.samplez'; did you mean scst.samples?"
    """
    section = key.partition(".")[0]
    near = difflib.get_close_matches(key, list(known), n=4, cutoff=0.5) or [
        k for k in known if k.startswith(section + ".")]
    return InputError(f"unknown config key {key!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))


def registered(registry: dict, key: str, name: str):
    """The entry ``name`` of a registry (decoders, encoders) that config key ``key`` chooses from; an InputError
    naming the key, the choices and the nearest one otherwise.

    >>> registered({"attention": 1, "transformer": 2}, "model.decoder", "transformer")
    2
    """
    if name not in registry:
        near = difflib.get_close_matches(name, list(registry), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise InputError(f"config key {key} must be one of {', '.join(registry)}, got {name!r}{hint}")
    return registry[name]


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def convert(key: str, f: dataclasses.Field, kind, value, from_text: bool):
    """Checks ``value`` against the field's type, choices and range (parsing it first when it came from
    --set)."""
    raw = value
    try:
        if kind is bool:
            if from_text or isinstance(value, str):
                text = str(value).strip().lower()
                if text not in _TRUE | _FALSE:
                    raise ValueError
                value = text in _TRUE
            elif not isinstance(value, bool):
                raise ValueError
        elif kind is int:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise ValueError
            value = int(str(value).strip()) if from_text else value
            if value not in _INT64:
                raise InputError(f"config key {key} must be a 64-bit integer, got {excerpt(raw)}")
        elif kind is float:
            # YAML 1.1 reads 5e-4 (no dot) as a string, so a float field also takes numeric strings.
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            value = float(str(value).strip()) if isinstance(value, str) else float(value)  # OverflowError
            if not math.isfinite(value):  # nan, inf, 1e999: no key means anything by them
                raise InputError(f"config key {key} must be a finite number, got {excerpt(raw)}")
        elif kind is str:
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise ValueError
            value = value.strip() if from_text else value
        elif typing.get_origin(kind) is list and typing.get_args(kind) == (str,):  # words
            if from_text:
                text = str(value).strip().strip("[]")
                value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()] if text else []
            elif not isinstance(value, list) or any(not isinstance(v, str) for v in value):
                raise ValueError
            value = list(value)
            if any(not v or any(c.isspace() for c in v) for v in value):
                raise ValueError
        elif typing.get_origin(kind) is list:
            if from_text:
                text = str(value).strip().strip("[]")
                value = [int(v) for v in text.split(",") if v.strip()] if text else []
            elif not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise ValueError
            value = list(value)
            if any(v not in _INT64 for v in value):
                raise InputError(f"config key {key} must hold 64-bit integers, got {excerpt(raw)}")
        else:  # pragma: no cover - a new field type must be added above
            raise TypeError(f"config field {key} has unsupported type {kind}")
    except (ValueError, OverflowError):  # OverflowError: float() of an int beyond the float range
        name = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
            kind, "a list of words like [a, the]" if typing.get_args(kind) == (str,) else "a list of integers like [8, 12]")
        raise InputError(f"config key {key} must be {name}, got {excerpt(value)}") from None
    options = f.metadata.get("choices")
    if options and value not in options:
        raise InputError(f"config key {key} must be one of {', '.join(options)}, got {excerpt(value)}")
    bounds = f.metadata.get("range")
    if bounds and not in_range(value, bounds):
        raise InputError(f"config key {key} must be {describe_range(bounds)}, got {value!r}")
    return value


def section_from(cls, values: dict, prefix: str, complete: bool = False, where: str = "config"):
    """An instance of the section dataclass ``cls`` from ``{name: value}`` (a value given with ``--set``
    is a :class:`Given`), every value converted and checked as its field declares, then the section's
    :meth:`Section.check`; InputError naming ``prefix + name`` otherwise. ``complete``: every field must
    be given (a saved config.yaml). The loader reads the shared sections with it, the components their
    own settings (the module docstring)."""
    fields = fields_of(cls)
    hints = type_hints(cls)
    out = cls()
    for name, value in values.items():
        if name not in fields:
            raise unknown_key(prefix + str(name), [prefix + k for k in fields])
        text = isinstance(value, Given)
        setattr(out, name, convert(prefix + name, fields[name], hints[name], value.text if text else value, text))
    if complete:
        missing = [prefix + k for k in fields if k not in values]
        if missing:
            raise InputError(f"{where} lacks {len(missing)} of its keys ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is cut short or damaged")
    if callable(getattr(out, "check", None)):  # a Section, or a component's settings that check themselves
        out.check(prefix)
    return out

