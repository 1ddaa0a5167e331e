"""Experiment configs: YAML files with ``base:`` inheritance and ``--set`` overrides, loaded into typed sections.

A config file sets any subset of the keys; what it does not set keeps the default. ``base:`` names
another config (a path relative to the file) whose values come first; chains are allowed, cycles are
errors. ``--set section.key=value`` overrides come last and are parsed by the key's type (``true``/``no``
for booleans, ``[8, 12]`` or ``8,12`` for lists). An unknown key, a value of the wrong type, a value
outside its choices or outside its range (every number has one, with an upper bound: ``train.warmup_steps``
in [0, 10⁹], ``model.dropout`` in [0, 1), the ``MAX_*`` constants of :mod:`captioning.config.settings`) is an
:class:`~captioning.errors.InputError` naming the key and what it takes (a component's key, below: when
its stage types it); so are a number that is not
finite (``nan``, ``inf``, ``1e999``), an integer beyond 64 bits and a config file that cannot be read (a
folder, not UTF-8, nested too deeply). Whatever the file or the override says, loading gives a valid
config or that one-line error, never another exception (tests/test_config.py checks this with
hypothesis). All of it runs before TensorFlow's runtime starts.

Example (``experiments/show_and_tell_coco_finetune.yaml``)::

    base: show_and_tell_coco.yaml
    model:
      encoder_trainable: true
    train:
      learning_rate: 0.0005

**Where things are.** This module is the loader: reading the files, ``--set``, the checks across
sections (:func:`validate`), writing a config back (:func:`save_config`); the package's other modules
(:mod:`captioning.config`) hold the typing engine, the shared sections and the migrations. The sections
every stage reads stay in this base package rather than in the stage that uses each most: the loader
types them before TensorFlow loads, the base imports no stage, and several stages read each.

**Components own their settings.** ``model:`` holds the keys every model has (:class:`ModelConfig`: the
decoder's name, the encoder, dropout) and, in the same section, the chosen decoder's own settings
(``model.lstm_units``, ...), which the decoder's module declares as a dataclass (``captioning.model``).
A training objective's settings are a section of their own, named after it (``scst:``), declared by the
objective's module (``captioning.train.objectives.scst.ScstSettings``). This module imports no stage, so
it keeps those keys as given — in :attr:`ModelConfig.options`, and in a :class:`ComponentSection` for
``scst:`` — and the component's stage types and checks them with the same ``section_from``
(``captioning.model.resolve``, ``captioning.train.objectives.resolve``), once, when the composition root
(``captioning.experiment``) makes the config an experiment, before anything is read or written. There a decoder's or encoder's key that the
user gave (with ``--set`` or in the file itself, not in a ``base:``: :meth:`Config.given` says which) and the
chosen ones do not read is refused (``captioning.model.check_read``). A new decoder or objective adds no
field here; a new objective section adds one :class:`Config` field (tests/test_objectives.py checks
that they match).

Only ``yaml.safe_load`` is used: a config can never construct Python objects.
"""

from __future__ import annotations

import copy
import difflib
import os
import typing
from dataclasses import dataclass, field

import yaml

from captioning.config.migrations import FORMAT_VERSION, migrate
from captioning.config.sections import DataConfig, DecodeConfig, DistributeConfig, TrainConfig
from captioning.errors import InputError, excerpt
from captioning.fileio import atomic_write_text
from captioning.config.settings import (MAX_FEATURE_SIZE, NOT_A_KEY, Given, Section, between, choices, convert, fields_of, type_hints,
                                 unknown_key)


@dataclass
class ModelConfig(Section):
    """The keys every model has. The decoder's own settings (``model.lstm_units`` for Show and Tell,
    ``model.attention_size`` for soft attention, ...) are declared by the decoder's module and kept in
    :attr:`options` as given, until the model stage checks them (``captioning.model.resolve``)."""

    # one of captioning.model.DECODERS: show_and_tell (Vinyals et al. 2015), attention (soft attention,
    # Xu et al. 2015), transformer (Vaswani et al. 2017), updown (Anderson et al. 2018); checked with its
    # settings by the model stage
    decoder: str = "show_and_tell"
    # one of captioning.model.encoders.ENCODERS (docs/encoders.md); checked with its own settings by the model stage
    encoder: str = "inception_v3"
    encoder_weights: str = "none"  # none | imagenet | a path to a weights file (keras_hub: its preset's)
    encoder_trainable: bool = False
    sync_batch_norm: bool = True  # a trainable encoder's batch-norm statistics over the global batch
    # the decoder's dropout (Show and Tell: on the LSTM's inputs and outputs; im2txt: keep probability 0.7)
    dropout: float = field(default=0.3, metadata=between(0.0, 1.0, high_open=True))
    # the size of each region's features, for data.features: regions (the decoder reads them instead of the
    # encoder's grid; training sets it from the features store); 0: the decoder reads the encoder's output
    region_feature_size: int = field(default=0, metadata=between(0, MAX_FEATURE_SIZE))
    # data.features: regions — each region's box as 5 more features: x1, y1, x2, y2 (fractions of the image's
    # width and height) and its area's fraction of the image (self-critical.pytorch's use_box)
    box_geometry: bool = False
    # data.features: regions — whether the regions were pooled from this model's own encoder (training sets it
    # when the features store was written by `captioning features extract` with an encoder like this model's,
    # whose weights it then starts from), so `caption --detections` and the SavedModel can pool the regions of
    # new images from their boxes; false for imported features (a detector this project cannot run)
    regions_from_encoder: bool = False
    # the decoder's and the encoder's own keys as given, until they are typed: {name: value} as the file gave
    # them, or {name: Given(text)} from --set
    options: dict = field(default_factory=dict, metadata=NOT_A_KEY)
    # the chosen decoder's and encoder's settings (instances of their classes' settings_class), typed once by
    # the model stage (captioning.model.type_components, which empties options); None until then
    decoder_settings: typing.Any = field(default=None, metadata=NOT_A_KEY)
    encoder_settings: typing.Any = field(default=None, metadata=NOT_A_KEY)

    @property
    def components(self) -> dict:
        """The decoder's and the encoder's keys, ``{name: value}``: every one of them, typed, once they are
        (:attr:`typed`); as given until then."""
        if not self.typed:
            return dict(self.options)
        return {name: getattr(one, name) for one in (self.decoder_settings, self.encoder_settings)
                for name in fields_of(type(one))}

    @property
    def typed(self) -> bool:
        """Whether the components' settings are typed (:attr:`decoder_settings`, :attr:`encoder_settings`)."""
        return self.decoder_settings is not None


class ComponentSection(dict):
    """A section whose keys a component declares (``scst:``, the SCST objective's settings): ``{name:
    value}`` as the config gave it (a value from ``--set`` as a :class:`~captioning.config.settings.Given`), kept
    until the component's stage types it with :func:`~captioning.config.settings.section_from` and puts its
    settings dataclass in its place (``captioning.train.objectives.resolve``). A model folder's
    ``config.yaml`` read by the model stage keeps it so (no command but ``train`` reads it)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{name!r}: this section's settings are not typed yet; its component types them "
                             "(captioning.train.objectives.resolve)")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # train.objective: scst — the SCST objective's settings, captioning.train.objectives.scst.ScstSettings once
    # the training stage typed them (a ComponentSection until then)
    scst: object = field(default_factory=ComponentSection)
    # where each key got its value when the config was loaded, {key: "file" | "base" | "set"} (:meth:`given`);
    # a copy of the config keeps it (no section: it is not written back)
    provenance: dict = field(default_factory=dict, repr=False, compare=False, metadata=NOT_A_KEY)

    def given(self, key: str) -> str | None:
        """Where ``key`` (``"data.captions_per_image"``) got its value when this config was loaded:
        ``"file"`` (the config file named), ``"base"`` (one of its ``base:`` files, or a program's
        ``defaults``), ``"set"`` (an override), or None (its default)."""
        return self.provenance.get(key)


_ALL = {name: f.default_factory for name, f in fields_of(Config).items()}  # every section, in file order
COMPONENT_SECTIONS = tuple(name for name, kind in _ALL.items() if kind is ComponentSection)
_SECTIONS = {name: kind for name, kind in _ALL.items() if kind is not ComponentSection}  # typed here


def _nested(cls, name: str):
    """The section dataclass of ``cls``'s key ``name`` when that key is a section of its own
    (``train.scheduled_sampling``), else None."""
    kind = type_hints(cls).get(name) if name in fields_of(cls) else None
    return kind if isinstance(kind, type) and issubclass(kind, Section) else None


def _leaf_keys(prefix: str, cls) -> list[str]:
    return [key for name in fields_of(cls) for key in (
        _leaf_keys(f"{prefix}{name}.", _nested(cls, name)) if _nested(cls, name) else [prefix + name])]


def all_keys() -> list[str]:
    """Every key of the sections typed here, a nested section's as ``train.scheduled_sampling.max`` (the
    decoders' own keys: ``captioning.model.all_keys``; the objectives': ``captioning.train.objectives.all_keys``)."""
    return [key for s, cls in _SECTIONS.items() for key in _leaf_keys(f"{s}.", cls)]


def _unknown(key: str) -> InputError:
    section, dot, _ = key.partition(".")
    sections = list(_ALL)
    if not dot and section in sections:
        example = next(iter(fields_of(_SECTIONS[section]))) if section in _SECTIONS else "KEY"
        return InputError(f"config key {key!r} names a section: give section.key=value, e.g. {section}."
                          f"{example}=...")
    if section not in sections:
        near = difflib.get_close_matches(section, sections, n=2, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        what = f"config section {section!r}" if not dot else f"config section {section!r} (in {key!r})"
        return InputError(f"unknown {what}; {hint}sections are {', '.join(sections)}")
    return unknown_key(key, all_keys())


def _set(config: Config, key: str, value, from_text: bool) -> list[str]:
    """Sets ``key`` (``section.key``, or ``section.sub.key`` in a nested section) to ``value``; a nested section's
    whole mapping from a file sets each of its keys. Returns the keys set."""
    section, dot, name = key.partition(".")
    if not dot or section not in _ALL:
        raise _unknown(key)
    if section in COMPONENT_SECTIONS or (section == "model" and name not in fields_of(ModelConfig)):
        if not name.isidentifier():  # a component's key: kept as given, typed by its stage
            raise _unknown(key)
        target = config.model.options if section == "model" else getattr(config, section)
        target[name] = Given(str(value)) if from_text else value
        return [key]
    owner, cls = getattr(config, section), _SECTIONS[section]
    name, dot, rest = name.partition(".")
    while _nested(cls, name):
        if not dot:  # the nested section itself: a mapping in a file
            if from_text or not isinstance(value, dict):
                raise InputError(f"config key {key!r} names a section: give {key}.KEY=value, e.g. "
                                 f"{key}.{next(iter(fields_of(_nested(cls, name))))}=...")
            return [k for sub, v in value.items() for k in _set(config, f"{key}.{sub}", v, False)]
        owner, cls = getattr(owner, name), _nested(cls, name)
        name, dot, rest = rest.partition(".")
    if dot or name not in fields_of(cls):
        raise _unknown(key)
    setattr(owner, name, convert(key, fields_of(cls)[name], type_hints(cls)[name], value, from_text))
    return [key]


def _set_section(config: Config, section: str, values, where: str, given: dict, how: str = "file") -> None:
    if values is None:  # "train:" with nothing under it
        return
    if not isinstance(values, dict):
        raise InputError(f"{where}: section {section!r} must be a mapping of keys")
    for name, value in values.items():
        for key in _set(config, f"{section}.{name}", value, from_text=False):
            given[key] = how


def _set_overrides(config: Config, overrides: typing.Sequence[str], given: dict, how: str) -> None:
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq:
            raise InputError(f"`overrides` {excerpt(override)} must look like section.key=value", params=("overrides",))
        for set_key in _set(config, key.strip(), value, from_text=True):
            given[set_key] = how


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """The file and its bases, base first, as (path, mapping) pairs."""
    path = os.path.abspath(path)
    shown = path if path.isprintable() else ascii(path)  # error messages stay on one line
    if path in chain:
        cycle = (p if p.isprintable() else ascii(p) for p in chain + (path,))
        raise InputError(f"config {shown} inherits from itself: {' -> '.join(cycle)}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise InputError(f"config {shown} does not exist") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise InputError(f"config {shown} is not valid YAML{where}: {excerpt(problem, 200, quote=False)}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"config {shown} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise InputError(f"config {shown} is nested too deeply to be a config") from None
    except (OSError, ValueError) as e:  # a folder, a name too long, a NUL byte in the name, no permission
        raise InputError(f"cannot read config {shown}: {getattr(e, 'strerror', None) or e}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise InputError(f"config {shown} must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    layers = []
    if base:
        layers = _read_yaml(os.path.join(os.path.dirname(path), str(base)), chain + (path,))
    return layers + [(shown, data)]


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), complete: bool = False,
                defaults: typing.Sequence[str] = ()) -> Config:
    """Defaults ← ``defaults`` ← ``path``'s bases ← ``path`` ← ``overrides`` (``"section.key=value"`` strings).
    ``defaults`` are a program's own values under everything the user gives, counted as a base's
    (:meth:`Config.given`: a component that does not read one is not told, ``captioning.model.resolve``).

    ``complete=True`` is for a config this project wrote with every key (a model folder's
    ``config.yaml``): an older format is migrated first (:mod:`captioning.config.migrations`), then a
    missing key means the file was cut short or damaged, an InputError naming it, instead of a silent
    default (a component's keys: when its stage types them with ``complete=True``)."""
    config = Config()
    given: dict[str, str] = {}
    _set_overrides(config, defaults, given, "base")
    layers = _read_yaml(path) if path else []
    for i, (source, data) in enumerate(layers):
        if complete:
            data = migrate(data, f"config {source}")
        else:
            data.pop("format_version", None)
        for section, values in data.items():
            if section not in _ALL:
                raise _unknown(str(section))
            _set_section(config, section, values, f"config {source}", given, "file" if i == len(layers) - 1 else "base")
    if complete:
        missing = [k for k in all_keys() if k not in given]
        if missing:
            raise InputError(f"config {path} lacks {len(missing)} of its keys ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is cut short or damaged")
    _set_overrides(config, overrides, given, "set")
    for name in _SECTIONS:
        getattr(config, name).check(f"{name}.")
    config.provenance = given
    return config


def with_absolute_paths(config: Config) -> Config:
    """A copy whose file and folder paths (``data.dir``, ``data.cache_dir``, a weights file in
    ``model.encoder_weights``) are absolute, resolved against the working directory: what a model folder
    records, so that later commands work from any directory."""
    out = copy.deepcopy(config)
    out.data.dir = os.path.abspath(out.data.dir) if out.data.dir else ""
    out.data.cache_dir = os.path.abspath(out.data.cache_dir) if out.data.cache_dir else ""
    if out.model.encoder_weights not in ("", "none", "imagenet"):
        out.model.encoder_weights = os.path.abspath(out.model.encoder_weights)
    return out


def _plain(value):
    if isinstance(value, Section):  # a nested section (train.scheduled_sampling): its keys
        return {k: _plain(getattr(value, k)) for k in fields_of(type(value))}
    return value.literal() if isinstance(value, Given) else list(value) if isinstance(value, list) else value


def to_dict(config: Config) -> dict:
    """Every key, section by section; the decoder's own keys sit in ``model`` beside the shared ones, an
    objective's section holds its settings (every one once typed, as given before)."""
    out = {}
    for name in _ALL:
        section = getattr(config, name)
        if isinstance(section, ComponentSection):
            out[name] = {k: _plain(v) for k, v in section.items()}
            continue
        values = {k: _plain(getattr(section, k)) for k in fields_of(type(section))}  # a typed component's too
        if name == "model":  # the components' keys: typed, every one; as given until then
            values.update({k: _plain(v) for k, v in section.components.items()})
        out[name] = values
    return out


def from_dict(data: dict) -> Config:
    """The inverse of :func:`to_dict`, with the same checks as a YAML file."""
    config = Config()
    given: dict[str, str] = {}
    for section, values in data.items():
        if section not in _ALL:
            raise _unknown(str(section))
        _set_section(config, section, values, "config", given)
    return config


def save_config(config: Config, path: str) -> None:
    """Writes the resolved config (every key, and the format version) as YAML, atomically."""
    save_record(to_dict(config), path)


def save_record(record: dict, path: str) -> None:
    """Writes a config's record (:func:`to_dict`'s sections and keys) with the format version as YAML,
    atomically: what :func:`load_config` with ``complete=True`` reads back."""
    atomic_write_text(path, yaml.safe_dump({"format_version": FORMAT_VERSION, **record}, sort_keys=False))


def ineffective(config: Config) -> list[str]:
    """One line for each setting that does nothing with the others, across sections (a warning, not an error, as
    :meth:`~captioning.config.sections.DecodeConfig.ineffective`'s: a base config may serve several runs; a data
    source's are its own ``ineffective``).

    >>> ineffective(Config(train=TrainConfig(encoder_lr_scale=0.1)))[0]
    'train.encoder_lr_scale 0.1 does nothing: the encoder is frozen (model.encoder_trainable: false)'
    """
    out = []
    m, t = config.model, config.train
    if t.encoder_lr_scale != TrainConfig().encoder_lr_scale and not m.encoder_trainable:
        out.append(f"train.encoder_lr_scale {t.encoder_lr_scale:g} does nothing: the encoder is frozen "
                   "(model.encoder_trainable: false)")
    settings = m.decoder_settings if m.typed else None  # a language model's trainability: prefix_lm's keys
    read = (lambda key: getattr(settings, key, None)) if settings is not None else m.options.get
    if t.lm_lr_scale != TrainConfig().lm_lr_scale and not (read("lm_trainable") or read("lm_lora_rank")):
        out.append(f"train.lm_lr_scale {t.lm_lr_scale:g} does nothing: no language model is trained "
                   "(model.decoder: prefix_lm with model.lm_trainable or model.lm_lora_rank)")
    return out


def validate(config: Config) -> None:
    """Checks that concern several sections at once (each section checks its own keys as it loads; what
    ``data.features`` asks of the others is its data source's ``check``, a stage's); raises InputError."""
    d, m = config.data, config.model
    if not d.dir:
        raise InputError("data.dir is not set: point it at a folder written by `captioning prepare`")
    if d.cache == "features" and (m.encoder_trainable or d.random_crop or d.random_flip or d.color_jitter):
        raise InputError("data.cache: features caches the frozen encoder's outputs, so it needs "
                         "model.encoder_trainable: false and data.random_crop, data.random_flip and "
                         "data.color_jitter all false")
    if config.train.steps_per_execution > 1 and d.service:
        raise InputError(f"train.steps_per_execution ({config.train.steps_per_execution}) reads the batches inside "
                         "the compiled call, where a stalled tf.data service cannot be watched: use 1 with "
                         "data.service")
    for name in _ALL:
        check = getattr(getattr(config, name), "check", None)  # a component's settings check themselves once typed
        if callable(check):
            check(f"{name}.")
