"""Experiment configs: typed dataclasses loaded from YAML, with ``base:`` inheritance and overrides.

A config file sets any subset of the keys below; what it does not set keeps the default. ``base:`` names
another config (a path relative to the file) whose values come first; chains are allowed, cycles are
errors. ``--set section.key=value`` overrides come last and are parsed by the key's type (``true``/``no``
for booleans, ``[8, 12]`` or ``8,12`` for lists). An unknown key, a value of the wrong type or a value
outside its choices is an :class:`~captioning.errors.InputError` naming the valid keys nearby; so are a
number that is not finite (``nan``, ``inf``, ``1e999``), an integer beyond 64 bits and a config file that
cannot be read (a folder, not UTF-8, nested too deeply). Whatever the file or the override says, loading
gives a valid config or that one-line error, never another exception (tests/test_config.py checks this
with hypothesis).

Example (``experiments/show_and_tell_coco_finetune.yaml``)::

    base: show_and_tell_coco.yaml
    model:
      encoder_trainable: true
    train:
      learning_rate: 0.0005

Only ``yaml.safe_load`` is used: a config can never construct Python objects.

(Over 350 lines for one responsibility: the sections' dataclasses are the list of every key with its
default and meaning, and the reading, type checking and cross-key validation of them belong beside it.)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field

import yaml

from captioning.errors import InputError
from captioning.fileio import atomic_write_text


def _choices(*values: str) -> dict:
    return {"choices": values}


@dataclass
class DataConfig:
    dir: str = ""  # a folder written by `captioning prepare` (manifest.json, vocab.txt, shards)
    train_split: str = "train"
    eval_split: str = "val"
    image_size: int = 299  # side of the square crop the encoder sees
    resize_size: int = 346  # images are resized to this square before the crop (im2txt: 346 → 299)
    # all: every caption is an example (its image copied into its batch); sample: one random caption per
    # image and epoch; grouped: batches of images with all their captions, each image encoded once per
    # step and its features repeated per caption on the device (captioning.batching)
    captions_per_image: str = field(default="all", metadata=_choices("all", "sample", "grouped"))
    # grouped: how many of each image's captions a batch holds: 0, all of them (every caption once per
    # epoch); k, k drawn afresh every epoch, without replacement (self-critical.pytorch's seq_per_img),
    # so every batch holds exactly images x k captions (an image with fewer gives all it has)
    group_captions: int = 0
    cache: str = field(default="none", metadata=_choices("none", "memory", "disk", "features"))
    cache_dir: str = ""  # for cache: disk and features (default: <model_dir>/cache)
    shuffle_buffer: int = 2048  # records (no cache) or cached images
    parse_batch_size: int = 64  # records parsed per tf.io.parse_example call
    length_window: int = 16  # batches' worth of captions sorted by length together (1: no grouping)
    bucket_boundaries: list[int] = field(default_factory=list)  # pad batches up to these lengths (XLA); []: to the longest
    random_crop: bool = True
    random_flip: bool = True
    color_jitter: bool = False
    deterministic: bool = False  # fixed element order (slower); training is non-deterministic by default
    # false: a damaged shard stops the command with one line naming it; true: each shard is scanned once
    # per process and its corrupt or unparsable records are skipped (and counted in a warning)
    skip_corrupt: bool = False
    # HOST:PORT of a tf.data service dispatcher (captioning data-service): the training pipeline's work —
    # reading, parsing, decoding, cropping, batching — runs on its workers, which must see data.dir at the
    # same path; "": on this host (captioning.data_service). Evaluation always runs here.
    service: str = ""
    # parallel_epochs: every service worker runs the whole (repeating) pipeline, caches included;
    # distributed_epoch: the shards are split among the workers, each image once per epoch
    service_mode: str = field(default="parallel_epochs", metadata=_choices("parallel_epochs", "distributed_epoch"))
    service_timeout_s: int = 60  # the dispatcher must answer within this, at the start and while training
    # how workers compress batches for the trip to the trainer: none (default: the batches are decoded
    # pixels; with auto, TF's default, one local worker gave 0.42 of the in-process pipeline's images/s
    # against 0.59 without: benchmarks/RESULTS.md), snappy, or auto
    service_compression: str = field(default="none", metadata=_choices("none", "snappy", "auto"))
    seed: int = 0


@dataclass
class ModelConfig:
    # show_and_tell (Vinyals et al. 2015) or attention (soft attention, Xu et al. 2015): one of
    # captioning.model.DECODERS (checked when the model is built)
    decoder: str = "show_and_tell"
    encoder: str = field(default="inception_v3", metadata=_choices(
        "inception_v3", "resnet50", "efficientnet_b0", "mobilenet_v2", "small_cnn"))
    encoder_weights: str = "none"  # none | imagenet | a path to a weights file
    encoder_trainable: bool = False
    sync_batch_norm: bool = True  # a trainable encoder's batch-norm statistics over the global batch
    embedding_size: int = 512
    lstm_units: int = 512
    dropout: float = 0.3  # on the LSTM's inputs and outputs (im2txt: keep probability 0.7)
    init_scale: float = 0.08  # uniform initialisation in [-init_scale, init_scale]
    attention_size: int = 512  # attention: the hidden size of the attention MLP
    # attention: λ of the doubly stochastic regularisation, λ Σ_cells (1 − Σ_words α)² per caption, added
    # to the caption's summed cross-entropy (Xu et al. 2015; 0 turns it off)
    attention_l1: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 1_000_000  # total, across restarts
    # xe: cross-entropy of the references (teacher forcing); scst: self-critical sequence training with a
    # CIDEr-D reward (the scst: section), usually continuing from an xe checkpoint
    objective: str = field(default="xe", metadata=_choices("xe", "scst"))
    batch_size: int = 32  # global: split evenly over replicas
    optimizer: str = field(default="sgd", metadata=_choices("sgd", "adam"))
    learning_rate: float = 2.0
    momentum: float = 0.0  # sgd: heavy-ball momentum (0: plain SGD, the paper's and im2txt's)
    lr_schedule: str = field(default="step", metadata=_choices("constant", "step", "exponential", "cosine"))
    lr_decay_factor: float = 0.5
    lr_decay_epochs: float = 8.0  # step / exponential schedules: one decay every this many epochs
    warmup_steps: int = 0
    clip_gradient_norm: float = 5.0  # 0 disables clipping
    # a step whose loss or gradient norm is NaN/Inf is never applied; then stop: exit 1 naming the step,
    # the last checkpoint kept as it is; skip: drop that batch, count it and train on
    nan_policy: str = field(default="stop", metadata=_choices("stop", "skip"))
    checkpoint_every_steps: int = 1000
    keep_checkpoints: int = 5
    log_every_steps: int = 100
    eval_every_steps: int = 1000  # validation loss / perplexity; 0 disables
    eval_batches: int = 20
    sample_captions: int = 3  # captions written to TensorBoard at each evaluation
    mixed_precision: bool = False
    # XLA for each replica's forward and backward pass (one compilation per batch shape: set
    # data.bucket_boundaries so there are few)
    jit_compile: bool = False
    # the teacher-forced decoder runs every caption to a cut chosen per batch, then only the longer ones
    # on, skipping most padded steps (captioning.model.base); not under jit_compile (shapes vary)
    split_padding: bool = False
    # [start, stop]: a TensorFlow profiler trace of steps start..stop into logs/train (TensorBoard's
    # Profile tab, with the tensorboard-plugin-profile package); []: no trace
    profile_steps: list[int] = field(default_factory=list)
    seed: int = 0


@dataclass
class ScstConfig:
    """Self-critical sequence training (``train.objective: scst``; captioning.train.scst)."""

    samples: int = 5  # captions sampled per image and step
    # mean: the mean reward of the image's other samples (self-critical.pytorch's "new SCST");
    # greedy: the reward of the image's greedy caption (Rennie et al. 2017)
    baseline: str = field(default="mean", metadata=_choices("mean", "greedy"))
    # words a sampled caption may have (self-critical.pytorch: 16, its COCO captions cut at 16 words). It
    # must hold the references: a sample cut short is rewarded cut and the model learns to leave things
    # out (training warns when more than 1% of the references are longer; shapes needs 20)
    max_length: int = 16
    temperature: float = 1.0  # sampling from softmax(logits / temperature)
    # the reward's n-grams end with <end> (appended to every reference; a sample has it if it chose it),
    # as self-critical.pytorch counts its <eos>: a caption that stops mid-phrase ("... and a") or not at
    # all loses the n-grams that end the references. false: words only, pycocoevalcap's CIDEr-D exactly
    end_in_reward: bool = True


@dataclass
class DistributeConfig:
    strategy: str = field(default="auto", metadata=_choices("auto", "default", "mirrored", "multi_worker", "tpu"))
    logical_cpus: int = 0  # split the CPU into this many logical devices (0 or 1: no split)
    tpu: str = ""  # TPU name or address, for strategy: tpu
    # multi_worker: a worker silent this long (no heartbeat to TF's coordination service) is lost, and the
    # others stop with an error naming it; workers wait this long for each other to start
    peer_timeout_s: int = 30
    startup_timeout_s: int = 600


@dataclass
class DecodeConfig:
    """How captions are generated (``evaluate``, ``caption``, ``export``, ``benchmark decode``, and the
    sample captions of training). Stored in the model folder's config.yaml like every section, so a model
    decodes the way it was set up; the commands' flags (``--beam-size``, ``--max-length``,
    ``--length-normalization``, ``--top-k``) override it for one call. These are the only defaults."""

    beam_size: int = 3
    max_length: int = 20  # words, <end> excluded
    length_normalization: float = 0.0  # rank beams by log p / length ** this (0: plain log p)
    top_k: int = 1  # captions returned per image, best first (caption, export)

    def check(self, prefix: str = "") -> "DecodeConfig":
        """Returns itself; an InputError naming the parameter (``prefix`` + name: ``decode.`` for the
        config keys) when a value cannot be used. Without a prefix they are marked as parameters
        (:class:`InputError`); config keys are written as they are."""
        names = ("beam_size", "max_length", "top_k", "length_normalization")
        b, n, k, a = (prefix + name if prefix else f"`{name}`" for name in names)
        params = () if prefix else names
        if self.beam_size < 1 or self.max_length < 1:
            raise InputError(f"{b} and {n} must be at least 1, got {self.beam_size} and {self.max_length}",
                             params=params)
        if not math.isfinite(self.length_normalization) or self.length_normalization < 0:
            raise InputError(f"{a} must be a finite number >= 0, got {self.length_normalization}", params=params)
        if not 1 <= self.top_k <= self.beam_size:
            raise InputError(f"{k} must be between 1 and {b} ({self.beam_size}), got {self.top_k}", params=params)
        return self

    def override(self, **values) -> "DecodeConfig":
        """A copy with the values that are not None replaced (a command's flags), checked."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None}).check()


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    scst: ScstConfig = field(default_factory=ScstConfig)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s, sf in _fields(Config).items() for k in _fields(sf.default_factory)]


def _unknown(key: str) -> InputError:
    section = key.split(".")[0]
    sections = list(_fields(Config))
    if section not in sections:
        near = difflib.get_close_matches(section, sections, n=2, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        return InputError(f"unknown config section {section!r} in {key!r}; {hint}sections are {', '.join(sections)}")
    near = difflib.get_close_matches(key, all_keys(), n=4, cutoff=0.5) or \
        [k for k in all_keys() if k.startswith(section + ".")]
    return InputError(f"unknown config key {key!r}; did you mean {', '.join(near)}?")


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_INT64 = range(-2**63, 2**63)  # what TensorFlow can hold; a larger int is refused here, not deep in a run


def _show(value) -> str:
    """``repr(value)`` cut to one short line for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _convert(key: str, f: dataclasses.Field, value, from_text: bool):
    """Checks ``value`` against the field's type (parsing it first when it came from --set)."""
    kind = typing.get_type_hints(_owner[key.split(".")[0]])[f.name]
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
                raise InputError(f"config key {key} must be a 64-bit integer, got {_show(raw)}")
        elif kind is float:
            # YAML 1.1 reads 5e-4 (no dot) as a string, so a float field also takes numeric strings.
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            value = float(str(value).strip()) if isinstance(value, str) else float(value)  # OverflowError
            if not math.isfinite(value):  # nan, inf, 1e999: no key means anything by them
                raise InputError(f"config key {key} must be a finite number, got {_show(raw)}")
        elif kind is str:
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise ValueError
            value = value.strip() if from_text else value
        elif typing.get_origin(kind) is list:
            if from_text:
                text = str(value).strip().strip("[]")
                value = [int(v) for v in text.split(",") if v.strip()] if text else []
            elif not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise ValueError
            value = list(value)
            if any(v not in _INT64 for v in value):
                raise InputError(f"config key {key} must hold 64-bit integers, got {_show(raw)}")
        else:  # pragma: no cover - a new field type must be added above
            raise TypeError(f"config field {key} has unsupported type {kind}")
    except (ValueError, OverflowError):  # OverflowError: float() of an int beyond the float range
        name = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
            kind, "a list of integers like [8, 12]")
        raise InputError(f"config key {key} must be {name}, got {_show(value)}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise InputError(f"config key {key} must be one of {', '.join(choices)}, got {_show(value)}")
    return value


_owner = {name: f.default_factory for name, f in _fields(Config).items()}


def _set(config: Config, key: str, value, from_text: bool) -> None:
    section, dot, name = key.partition(".")
    if not dot or section not in _owner or name not in _fields(_owner[section]):
        raise _unknown(key)
    f = _fields(_owner[section])[name]
    setattr(getattr(config, section), name, _convert(key, f, value, from_text))


def _set_section(config: Config, section: str, values, where: str) -> None:
    if values is None:  # "train:" with nothing under it
        return
    if not isinstance(values, dict):
        raise InputError(f"{where}: section {section!r} must be a mapping of keys")
    for name, value in values.items():
        _set(config, f"{section}.{name}", value, from_text=False)


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
        raise InputError(f"config {shown} is not valid YAML{where}: {problem}") from None
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


# Keys added after model folders began to record every key: a model folder's config.yaml written before
# a key existed may lack it, and gets its default.
ADDED_LATER: frozenset[str] = frozenset({"distribute.peer_timeout_s", "distribute.startup_timeout_s",
                                          "model.decoder", "decode.beam_size", "decode.max_length",
                                          "decode.length_normalization", "decode.top_k",
                                          "train.jit_compile", "train.split_padding", "data.group_captions",
                                          "train.momentum", "model.attention_size", "model.attention_l1",
                                          "train.objective", "scst.samples", "scst.baseline", "scst.max_length",
                                          "scst.temperature", "scst.end_in_reward", "data.service",
                                          "data.service_mode", "data.service_timeout_s", "data.service_compression"})


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), complete: bool = False) -> Config:
    """Defaults ← ``path`` and its bases ← ``overrides`` (``"section.key=value"`` strings).

    ``complete=True`` is for a config this project wrote with every key (a model folder's
    ``config.yaml``): a missing key means the file was cut short or damaged, an InputError naming it,
    instead of a silent default (keys in :data:`ADDED_LATER` excepted)."""
    config = Config()
    given: set[str] = set()
    for source, data in _read_yaml(path) if path else []:
        for section, values in data.items():
            if section not in _owner:
                raise _unknown(str(section))
            _set_section(config, section, values, f"config {source}")
            given.update(f"{section}.{k}" for k in (values or {}))
    if complete:
        missing = [k for k in all_keys() if k not in given and k not in ADDED_LATER]
        if missing:
            raise InputError(f"config {path} lacks {len(missing)} of its keys ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is cut short or damaged")
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq:
            raise InputError(f"`overrides` {override!r} must look like section.key=value", params=("overrides",))
        _set(config, key.strip(), value, from_text=True)
    return config


def with_absolute_paths(config: Config) -> Config:
    """A copy whose file and folder paths (``data.dir``, ``data.cache_dir``, a weights file in
    ``model.encoder_weights``) are absolute, resolved against the working directory: what a model folder
    records, so that later commands work from any directory."""
    out = from_dict(to_dict(config))
    out.data.dir = os.path.abspath(out.data.dir) if out.data.dir else ""
    out.data.cache_dir = os.path.abspath(out.data.cache_dir) if out.data.cache_dir else ""
    if out.model.encoder_weights not in ("", "none", "imagenet"):
        out.model.encoder_weights = os.path.abspath(out.model.encoder_weights)
    return out


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def from_dict(data: dict) -> Config:
    """The inverse of :func:`to_dict`, with the same checks as a YAML file."""
    config = Config()
    for section, values in data.items():
        if section not in _owner:
            raise _unknown(str(section))
        _set_section(config, section, values, "config")
    return config


def save_config(config: Config, path: str) -> None:
    """Writes the resolved config (every key) as YAML, atomically."""
    atomic_write_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))


def validate(config: Config) -> None:
    """Checks that concern several keys at once; raises InputError."""
    d, m, t = config.data, config.model, config.train
    if not d.dir:
        raise InputError("data.dir is not set: point it at a folder written by `captioning prepare`")
    if d.cache == "features" and (m.encoder_trainable or d.random_crop or d.random_flip or d.color_jitter):
        raise InputError("data.cache: features caches the frozen encoder's outputs, so it needs "
                         "model.encoder_trainable: false and data.random_crop, data.random_flip and "
                         "data.color_jitter all false")
    if d.image_size > d.resize_size:
        raise InputError(f"data.image_size ({d.image_size}) cannot exceed data.resize_size ({d.resize_size}): "
                         "images are resized, then cropped")
    for key, value in [("train.steps", t.steps), ("train.batch_size", t.batch_size),
                       ("train.checkpoint_every_steps", t.checkpoint_every_steps),
                       ("train.keep_checkpoints", t.keep_checkpoints), ("train.log_every_steps", t.log_every_steps),
                       ("data.image_size", d.image_size), ("data.parse_batch_size", d.parse_batch_size),
                       ("data.length_window", d.length_window),
                       ("model.embedding_size", m.embedding_size), ("model.lstm_units", m.lstm_units),
                       ("model.attention_size", m.attention_size),
                       ("distribute.peer_timeout_s", config.distribute.peer_timeout_s),
                       ("distribute.startup_timeout_s", config.distribute.startup_timeout_s)]:
        if value < 1:
            raise InputError(f"{key} must be at least 1, got {value}")
    config.decode.check(prefix="decode.")
    if t.objective == "scst":
        sc = config.scst
        if d.captions_per_image != "grouped" or d.group_captions:
            raise InputError("train.objective: scst rewards samples against every reference of their image: it "
                             "needs data.captions_per_image: grouped and data.group_captions: 0")
        if sc.samples < 1 or sc.max_length < 1 or (sc.baseline == "mean" and sc.samples < 2):
            raise InputError(f"scst.samples ({sc.samples}) must be at least 2 with scst.baseline: mean (1 with "
                             f"greedy), and scst.max_length ({sc.max_length}) at least 1")
        if sc.temperature <= 0:
            raise InputError(f"scst.temperature must be positive, got {sc.temperature}")
        if t.jit_compile:
            raise InputError("train.jit_compile does not apply to train.objective: scst (its sampling stops "
                             "captions at <end>, and the reward's lookup table runs on the host)")
    if d.service:
        from captioning.service_probe import parse_address

        parse_address(d.service, "data.service")
        if d.cache == "features":
            raise InputError("data.cache: features runs the encoder in the trainer and keeps its outputs in the "
                             "trainer's files, which tf.data service workers cannot serve: use data.cache: none, "
                             "memory or disk with data.service")
        if d.service_mode == "distributed_epoch" and d.cache != "none":
            raise InputError(f"data.cache: {d.cache} with data.service_mode: distributed_epoch would cache on each "
                             "worker only its share of an epoch: use data.service_mode: parallel_epochs to cache")
        if d.skip_corrupt:
            raise InputError("data.skip_corrupt reads damaged shards through scratch copies on the trainer's disk, "
                             "which tf.data service workers cannot see: prepare the dataset again instead")
        if d.service_timeout_s < 1:
            raise InputError(f"data.service_timeout_s must be at least 1, got {d.service_timeout_s}")
    if d.group_captions < 0:
        raise InputError(f"data.group_captions must be 0 (all) or more, got {d.group_captions}")
    if d.group_captions and d.captions_per_image != "grouped":
        raise InputError(f"data.group_captions ({d.group_captions}) applies to data.captions_per_image: grouped, "
                         f"not {d.captions_per_image}")
    if m.attention_l1 < 0:
        raise InputError(f"model.attention_l1 must be at least 0, got {m.attention_l1}")
    if not 0.0 <= m.dropout < 1.0:
        raise InputError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if not 0.0 <= t.momentum < 1.0:
        raise InputError(f"train.momentum must be in [0, 1), got {t.momentum}")
    if t.learning_rate <= 0:
        raise InputError(f"train.learning_rate must be positive, got {t.learning_rate}")
    if t.profile_steps and (len(t.profile_steps) != 2 or not 1 <= t.profile_steps[0] <= t.profile_steps[1]):
        raise InputError(f"train.profile_steps must be [start, stop] with 1 <= start <= stop, got {t.profile_steps}")
    if list(d.bucket_boundaries) != sorted(set(d.bucket_boundaries)) or any(b < 1 for b in d.bucket_boundaries):
        raise InputError(f"data.bucket_boundaries must be increasing positive lengths, got {d.bucket_boundaries}")
