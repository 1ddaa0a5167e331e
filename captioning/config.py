"""Experiment configs: typed dataclasses loaded from YAML, with ``base:`` inheritance and overrides.

A config file sets any subset of the keys below; what it does not set keeps the default. ``base:`` names
another config (a path relative to the file) whose values come first; chains are allowed, cycles are
errors. ``--set section.key=value`` overrides come last and are parsed by the key's type (``true``/``no``
for booleans, ``[8, 12]`` or ``8,12`` for lists). An unknown key, a value of the wrong type, a value
outside its choices or outside its range (every number has one, with an upper bound: ``train.warmup_steps``
in [0, 10⁹], ``model.dropout`` in [0, 1), the ``MAX_*`` constants below) is an :class:`~captioning.errors.InputError` naming the key and what
it takes; so are a number that is not finite (``nan``, ``inf``, ``1e999``), an integer beyond 64 bits
and a config file that cannot be read (a folder, not UTF-8, nested too deeply). Whatever the file or the
override says, loading gives a valid config or that one-line error, never another exception
(tests/test_config.py checks this with hypothesis). All of it runs before TensorFlow's runtime starts.

Example (``experiments/show_and_tell_coco_finetune.yaml``)::

    base: show_and_tell_coco.yaml
    model:
      encoder_trainable: true
    train:
      learning_rate: 0.0005

**Sections check themselves.** Each section is a dataclass: its fields are its keys, each with its
default, its type, and its choices or range in the field's metadata; its ``check()`` holds the rules
between its own keys. :func:`validate` adds the few rules that span sections.

**The decoder's settings belong to the decoder.** ``model:`` holds the keys every model has
(:class:`ModelConfig`: the decoder's name, the encoder, dropout) and, in the same section, the chosen
decoder's own settings (``model.lstm_units``, ``model.attention_size``, ...), which its module declares
as a dataclass of its own (``captioning.model``). This module keeps those keys as given
(:attr:`ModelConfig.options`); the model stage checks and types them (:func:`section_from` is the one
conversion both use), so a new decoder adds no field here.

**Format versions.** A model folder's ``config.yaml`` records every key and the format it was written in
(``format_version``; a file without one is format 1). Reading an older format applies the migrations of
:data:`MIGRATIONS` in order, each a function written once and never changed, so folders trained by
earlier versions of this code keep loading (tests/data/model_folders_v1 holds such files).

Only ``yaml.safe_load`` is used: a config can never construct Python objects.

(Over 350 lines for one responsibility: the sections' dataclasses are the list of every key with its
default and meaning, and the reading, type checking and migration of them belong beside it.)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field

import yaml

from captioning.errors import InputError, excerpt
from captioning.fileio import atomic_write_text

FORMAT_VERSION = 5  # of a saved config.yaml (see MIGRATIONS)
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


def _set_decode_overrides(config: "Config", overrides: typing.Sequence[str]) -> None:
    """``decode.KEY=VALUE`` overrides (a command's ``--set``) set on ``config``, each typed and range-checked
    alone; an InputError for any other key."""
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq or not key.strip().startswith("decode."):
            raise InputError(f"`overrides` {excerpt(override)} must look like decode.KEY=VALUE (only the decode: "
                             "section can change here)", params=("overrides",))
        _set(config, key.strip(), value, from_text=True)


def describe_range(bounds) -> str:
    """``at least 1``, ``more than 0`` or ``in [0, 1)``; integral bounds as integers.

    >>> describe_range(between(0, 2**31 - 1)["range"]), describe_range(more_than(0.0)["range"])
    ('in [0, 2147483647]', 'more than 0')
    """
    low, low_open, high, high_open = bounds
    if high is None:
        return f"{'more than' if low_open else 'at least'} {_bound(low)}"
    return f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"


def _in_range(value: float, bounds) -> bool:
    low, low_open, high, high_open = bounds
    above = value > low if low_open else value >= low
    below = high is None or (value < high if high_open else value <= high)
    return above and below


class Section:
    """What every config section is: a dataclass of keys (see the module docstring) that checks the
    rules between its own keys in :meth:`check`, naming them with ``prefix`` (``"train."``)."""

    def check(self, prefix: str) -> None:
        """InputError when keys of this section contradict each other (none by default)."""


@dataclass
class DataConfig(Section):
    dir: str = ""  # a folder written by `captioning prepare` (manifest.json, vocab.txt, shards)
    train_split: str = "train"
    eval_split: str = "val"
    # what the model reads of each image: images, the prepared JPEGs (decoded, resized, cropped); regions, the
    # region features of the features store data.features_store inside data.dir (`captioning features import` or
    # `extract`): no JPEG is decoded, each image brings its own number of regions, padded per batch with a
    # mask (captioning.data.region_input); the image augmentations and image sizes do not apply to them
    features: str = field(default="images", metadata=choices("images", "regions"))
    features_store: str = "regions"  # data.features: regions — the store's name (DATA/features/NAME)
    # side of the square crop the encoder sees
    image_size: int = field(default=299, metadata=between(1, MAX_IMAGE_SIZE))
    # images are resized to this square before the crop (im2txt: 346 → 299)
    resize_size: int = field(default=346, metadata=between(1, MAX_RESIZE_SIZE))
    # all: every caption is an example (its image copied into its batch); sample: one random caption per
    # image and epoch; grouped: batches of images with all their captions, each image encoded once per
    # step and its features repeated per caption on the device (captioning.data.batching)
    captions_per_image: str = field(default="all", metadata=choices("all", "sample", "grouped"))
    # grouped: how many of each image's captions a batch holds: 0, all of them (every caption once per
    # epoch); k, k drawn afresh every epoch, without replacement (self-critical.pytorch's seq_per_img),
    # so every batch holds exactly images x k captions (an image with fewer gives all it has)
    group_captions: int = field(default=0, metadata=between(0, MAX_GROUP_CAPTIONS))
    cache: str = field(default="none", metadata=choices("none", "memory", "disk", "features"))
    cache_dir: str = ""  # for cache: disk and features (default: <model_dir>/cache)
    # records (no cache) or cached images
    shuffle_buffer: int = field(default=2048, metadata=between(1, MAX_SHUFFLE_BUFFER))
    # records parsed per tf.io.parse_example call
    parse_batch_size: int = field(default=64, metadata=between(1, MAX_BATCH))
    # batches' worth of captions sorted by length together (1: no grouping)
    length_window: int = field(default=16, metadata=between(1, MAX_LENGTH_WINDOW))
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
    # same path; "": on this host (captioning.data.service). Evaluation always runs here. The servers have no
    # authentication: keep them on a private network (docs/distributed.md, "Trust model")
    service: str = ""
    # parallel_epochs: every service worker runs the whole (repeating) pipeline, caches included;
    # distributed_epoch: the shards are split among the workers, each image once per epoch
    service_mode: str = field(default="parallel_epochs", metadata=choices("parallel_epochs", "distributed_epoch"))
    # the dispatcher must answer, and have a live worker, within this many seconds: at the start and while
    # training (a run whose service stays unreachable or without workers that long ends with one line)
    service_timeout_s: int = field(default=60, metadata=between(1, MAX_SECONDS))
    # how workers compress batches for the trip to the trainer: none (default: the batches are decoded
    # pixels; with auto, TF's default, one local worker gave 0.42 of the in-process pipeline's images/s
    # against 0.59 without: benchmarks/RESULTS.md), snappy, or auto
    service_compression: str = field(default="none", metadata=choices("none", "snappy", "auto"))
    seed: int = field(default=0, metadata=between(0, SEED.stop - 1))

    def evaluation_input(self) -> dict:
        """The keys that decide what evaluation gives the model for each image: models whose values agree
        read the same batches (an ensemble is evaluated over one input).

        >>> DataConfig(image_size=64, resize_size=72).evaluation_input()
        {'features': 'images', 'image_size': 64, 'resize_size': 72}
        """
        if self.features == "regions":
            return {"features": self.features, "features_store": self.features_store}
        return {"features": self.features, "image_size": self.image_size, "resize_size": self.resize_size}

    def check(self, prefix: str = "data.") -> None:
        if self.image_size > self.resize_size:
            raise InputError(f"{prefix}image_size ({self.image_size}) cannot exceed {prefix}resize_size "
                             f"({self.resize_size}): images are resized, then cropped")
        if self.group_captions and self.captions_per_image != "grouped":
            raise InputError(f"{prefix}group_captions ({self.group_captions}) applies to {prefix}captions_per_image: "
                             f"grouped, not {self.captions_per_image}")
        if list(self.bucket_boundaries) != sorted(set(self.bucket_boundaries)) or any(b < 1 for b in self.bucket_boundaries):
            raise InputError(f"{prefix}bucket_boundaries must be increasing positive lengths, got {self.bucket_boundaries}")
        if self.features == "regions" and self.cache in ("disk", "features"):
            raise InputError(f"{prefix}cache: {self.cache} caches decoded images or their encoder features; "
                             f"{prefix}features: regions reads a features store, which is on disk already: use "
                             f"{prefix}cache: none or memory")
        if not self.service:
            return
        from captioning.service_probe import parse_address

        parse_address(self.service, f"{prefix}service")
        if self.cache == "features":
            raise InputError(f"{prefix}cache: features runs the encoder in the trainer and keeps its outputs in the "
                             "trainer's files, which tf.data service workers cannot serve: use data.cache: none, "
                             f"memory or disk with {prefix}service")
        if self.service_mode == "distributed_epoch" and self.cache != "none":
            raise InputError(f"{prefix}cache: {self.cache} with {prefix}service_mode: distributed_epoch would cache on "
                             "each worker only its share of an epoch: use data.service_mode: parallel_epochs to cache")
        if self.skip_corrupt:
            raise InputError(f"{prefix}skip_corrupt reads damaged shards through scratch copies on the trainer's disk, "
                             f"which tf.data service workers cannot see: prepare the dataset again instead")


@dataclass
class ModelConfig(Section):
    """The keys every model has. The decoder's own settings (``model.lstm_units`` for Show and Tell,
    ``model.attention_size`` for soft attention, ...) are declared by the decoder's module and kept in
    :attr:`options` as given, until the model stage checks them (``captioning.model.resolve``)."""

    # one of captioning.model.DECODERS: show_and_tell (Vinyals et al. 2015), attention (soft attention,
    # Xu et al. 2015), transformer (Vaswani et al. 2017), updown (Anderson et al. 2018); checked with its
    # settings by the model stage
    decoder: str = "show_and_tell"
    # one of captioning.model.encoders.ENCODERS (small_cnn, inception_v3, resnet50, efficientnet_b0,
    # mobilenet_v2, vit, keras_hub); checked with its own settings by the model stage
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
    # the decoder's own keys: {name: value} as the file gave them, or {name: Given(text)} from --set
    options: dict = field(default_factory=dict)


@dataclass
class TrainConfig(Section):
    steps: int = field(default=1_000_000, metadata=between(1, MAX_STEPS))  # total, across restarts
    # one of captioning.train.OBJECTIVES: xe, cross-entropy of the references (teacher forcing); scst,
    # self-critical sequence training with a CIDEr-D reward (the scst: section), usually continuing from
    # an xe checkpoint; checked by the training stage, which also brings the batches it needs
    objective: str = "xe"
    batch_size: int = field(default=32, metadata=between(1, MAX_BATCH))  # global: split evenly over replicas
    # sgd, adam, or adamw (Adam with decoupled weight decay, train.weight_decay; Loshchilov & Hutter 2019)
    optimizer: str = field(default="sgd", metadata=choices("sgd", "adam", "adamw"))
    # adamw: decay per step × learning rate
    weight_decay: float = field(default=0.01, metadata=between(0.0, MAX_FACTOR))
    # a rate, not a size: finite and positive, no upper bound (the tests drive a run to NaN with 1e30)
    learning_rate: float = field(default=2.0, metadata=more_than(0.0))
    # model.encoder_trainable: the encoder's learning rate is this times the decoder's (im2txt's second stage and
    # BLIP's fine-tuning train a pretrained encoder slower than the decoder: 0.1 is a common choice); 1: the same
    encoder_lr_scale: float = field(default=1.0, metadata=between(0.0, 100.0, low_open=True))
    # sgd: heavy-ball momentum (0: plain SGD, the paper's and im2txt's)
    momentum: float = field(default=0.0, metadata=between(0.0, 1.0, high_open=True))
    # constant, step, exponential, cosine, or noam (the Transformer's: linear warm-up over train.warmup_steps
    # to train.learning_rate, then × sqrt(warmup / step))
    lr_schedule: str = field(default="step", metadata=choices("constant", "step", "exponential", "cosine", "noam"))
    # step / exponential schedules: the rate is multiplied by this once per lr_decay_epochs
    lr_decay_factor: float = field(default=0.5, metadata=between(0.0, 1.0, low_open=True))
    # step / exponential schedules: one decay every this many epochs
    lr_decay_epochs: float = field(default=8.0, metadata=between(0.0, MAX_EPOCHS, low_open=True))
    warmup_steps: int = field(default=0, metadata=between(0, MAX_STEPS))  # linear warm-up from 0
    clip_gradient_norm: float = field(default=5.0, metadata=between(0.0, MAX_GRADIENT_NORM))  # 0 disables clipping
    # cross-entropy against (1 − ε) on the reference word and ε spread evenly over the vocabulary (Szegedy et
    # al. 2016; 0.1 in the Transformer paper); evaluation's perplexity is always of the plain cross-entropy
    label_smoothing: float = field(default=0.0, metadata=between(0.0, 1.0, high_open=True))
    # a step whose loss or gradient norm is NaN/Inf is never applied; then stop: exit 1 naming the step,
    # the last checkpoint kept as it is; skip: drop that batch, count it and train on
    nan_policy: str = field(default="stop", metadata=choices("stop", "skip"))
    checkpoint_every_steps: int = field(default=1000, metadata=between(1, MAX_STEPS))
    keep_checkpoints: int = field(default=5, metadata=between(1, MAX_KEPT_CHECKPOINTS))
    log_every_steps: int = field(default=100, metadata=between(1, MAX_STEPS))
    # validation loss / perplexity; 0 disables
    eval_every_steps: int = field(default=1000, metadata=between(0, MAX_STEPS))
    eval_batches: int = field(default=20, metadata=between(1, MAX_EVAL_BATCHES))
    # captions written to TensorBoard at each evaluation
    sample_captions: int = field(default=3, metadata=between(0, MAX_DECODE_BATCH))
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
    seed: int = field(default=0, metadata=between(0, SEED.stop - 1))
    # training steps inside one compiled call (Keras' name): k > 1 saves a small model the per-step Python and
    # dispatch overhead. Logging, checkpoints, evaluation, signals and NaN handling stay exact to the step: a
    # call never runs past a checkpoint, evaluation or profiled step, stops after a non-finite step under
    # nan_policy: stop, and a signal is answered at the end of the call (within k steps). The batches are
    # then read inside the call (not with data.service, whose watch needs each batch's arrival on the host)
    steps_per_execution: int = field(default=1, metadata=between(1, MAX_STEPS_PER_EXECUTION))

    def check(self, prefix: str = "train.") -> None:
        if self.lr_schedule == "noam" and self.warmup_steps < 1:
            raise InputError(f"{prefix}lr_schedule: noam rises over {prefix}warmup_steps, which must be at least 1, "
                             f"got {self.warmup_steps}")
        steps = self.profile_steps
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise InputError(f"{prefix}profile_steps must be [start, stop] with 1 <= start <= stop, got {steps}")


@dataclass
class ScstConfig(Section):
    """Self-critical sequence training (``train.objective: scst``; captioning.train.scst)."""

    samples: int = field(default=5, metadata=between(1, MAX_BEAM))  # captions sampled per image and step
    # mean: the mean reward of the image's other samples (self-critical.pytorch's "new SCST");
    # greedy: the reward of the image's greedy caption (Rennie et al. 2017)
    baseline: str = field(default="mean", metadata=choices("mean", "greedy"))
    # words a sampled caption may have (self-critical.pytorch: 16, its COCO captions cut at 16 words). It
    # must hold the references: a sample cut short is rewarded cut and the model learns to leave things
    # out (training warns when more than 1% of the references are longer; shapes needs 20)
    max_length: int = field(default=16, metadata=between(1, MAX_WORDS))
    # sampling from softmax(logits / temperature)
    temperature: float = field(default=1.0, metadata=between(0.0, MAX_TEMPERATURE, low_open=True))
    # the reward's n-grams end with <end> (appended to every reference; a sample has it if it chose it),
    # as self-critical.pytorch counts its <eos>: a caption that stops mid-phrase ("... and a") or not at
    # all loses the n-grams that end the references. false: words only, pycocoevalcap's CIDEr-D exactly
    end_in_reward: bool = True
    # draw the samples in a loop compiled with XLA, when they are drawn without gradient (the decoder's
    # fast_teacher_forcing): the same samples, the sampling loop ~3.5x faster for the shapes Transformer on
    # CPU; each new batch shape compiles once (1.4 s for it). false: the loop as plain TensorFlow ops
    xla_sampling: bool = True

    def check(self, prefix: str = "scst.") -> None:
        if self.baseline == "mean" and self.samples < 2:
            raise InputError(f"{prefix}samples ({self.samples}) must be at least 2 with {prefix}baseline: mean (the "
                             "baseline of a sample is the mean of the image's other samples)")


@dataclass
class DistributeConfig(Section):
    strategy: str = field(default="auto", metadata=choices("auto", "default", "mirrored", "multi_worker", "tpu"))
    # split the CPU into this many logical devices (0 or 1: no split)
    logical_cpus: int = field(default=0, metadata=between(0, MAX_CPUS))
    tpu: str = ""  # TPU name or address, for strategy: tpu
    # multi_worker: a worker silent this long (no heartbeat to TF's coordination service) is lost, and the
    # others stop with an error naming it; workers wait this long for each other to start
    peer_timeout_s: int = field(default=30, metadata=between(1, MAX_SECONDS))
    startup_timeout_s: int = field(default=600, metadata=between(1, MAX_SECONDS))


@dataclass
class DecodeConfig(Section):
    """How captions are generated (``evaluate``, ``caption``, ``export``, ``benchmark decode``, and the
    sample captions of training). Stored in the model folder's config.yaml like every section, so a model
    decodes the way it was set up; the commands' flags (``--beam-size``, ``--max-length``,
    ``--length-normalization``, ``--top-k``) override it for one call. These are the only defaults. Every size
    has an upper bound (:data:`MAX_BEAM`, :data:`MAX_WORDS`, :data:`MAX_SAMPLE_TOP_K`), checked before a model
    loads; :meth:`ineffective` names the settings that would do nothing."""

    beam_size: int = field(default=3, metadata=between(1, MAX_BEAM))
    max_length: int = field(default=20, metadata=between(1, MAX_WORDS))  # words, <end> excluded
    # rank beams by log p / length ** this (0: plain log p)
    length_normalization: float = field(default=0.0, metadata=between(0.0, MAX_LENGTH_NORMALIZATION))
    top_k: int = field(default=1, metadata=between(1, MAX_BEAM))  # captions returned per image, best first
    # beam: beam search; greedy: the most likely word each step (a beam of 1); sample: top_k captions per image
    # drawn from the model (temperature, sample_top_k, sample_top_p, seed), most likely first
    method: str = field(default="beam", metadata=choices("beam", "greedy", "sample"))
    # what a complete caption's log p is divided by: avg, length ** length_normalization; gnmt, Wu et al.'s
    # ((5 + length) / 6) ** length_normalization; none, 1
    length_penalty: str = field(default="avg", metadata=choices("none", "avg", "gnmt"))
    # diverse beam search (Vijayakumar et al. 2018): the beam in this many groups (they must divide beam_size),
    # each word's log p lowered by diversity x the earlier groups' captions that chose it at this step, that
    # penalised score carried forward; the top_k captions come one per group in turn
    beam_groups: int = field(default=1, metadata=between(1, MAX_BEAM))
    diversity: float = field(default=0.0, metadata=between(0.0, MAX_FACTOR))
    # n >= 1: no word twice in a row and (n >= 2) no n-gram twice in a caption, inside the search; 0: off
    block_ngrams: int = field(default=0, metadata=between(0, MAX_WORDS))
    # words a caption may not end with ("english": a list for English, captioning.model.word_rules.ENGLISH_BAD_ENDINGS;
    # a word the model's vocabulary lacks is refused)
    bad_endings: list[str] = field(default_factory=list)
    # sample: logits divided by this
    temperature: float = field(default=1.0, metadata=between(0.0, MAX_TEMPERATURE, low_open=True))
    # sample: only the k most likely words (0: all)
    sample_top_k: int = field(default=0, metadata=between(0, MAX_SAMPLE_TOP_K))
    # sample: only the fewest most likely words whose probability reaches this (nucleus sampling; 1: all)
    sample_top_p: float = field(default=1.0, metadata=between(0.0, 1.0, low_open=True))
    seed: int = field(default=0, metadata=between(0, SEED.stop - 1))  # sample: the same seed, the same captions

    def check(self, prefix: str = "") -> "DecodeConfig":
        """Returns itself; an InputError naming the parameter (``prefix`` + name: ``decode.`` for the
        config keys) when a value cannot be used. Without a prefix they are marked as parameters
        (:class:`InputError`); config keys are written as they are."""
        names = ("beam_size", "max_length", "top_k", "length_normalization")
        b, n, k, a = (prefix + name if prefix else f"`{name}`" for name in names)
        params = () if prefix else names
        self.check_ranges(prefix)
        if not math.isfinite(self.length_normalization) or self.length_normalization < 0:
            raise InputError(f"{a} must be a finite number >= 0, got {self.length_normalization}", params=params)
        if self.method == "greedy" and self.top_k != 1:
            raise InputError(f"{k} must be 1 with {prefix or ''}method greedy (one caption per image), got "
                             f"{self.top_k}", params=params)
        if self.method == "beam" and self.beam_size % self.beam_groups:
            g = prefix + "beam_groups" if prefix else "`beam_groups`"
            raise InputError(f"{g} ({self.beam_groups}) must divide {b} ({self.beam_size})",
                             params=params + (() if prefix else ("beam_groups",)))
        if self.method == "beam" and not 1 <= self.top_k <= self.beam_size:
            raise InputError(f"{k} must be between 1 and {b} ({self.beam_size}), got {self.top_k}", params=params)
        return self

    def check_ranges(self, prefix: str = "") -> None:
        """An InputError naming the first setting outside its range (the sizes' upper bounds among them), as
        loading a config checks them; settings given as flags (:meth:`override`) are checked here too."""
        for name, f in _fields(DecodeConfig).items():
            bounds = f.metadata.get("range")
            value = getattr(self, name)
            if bounds and not _in_range(value, bounds):
                where = prefix + name if prefix else f"`{name}`"
                raise InputError(f"{where} must be {describe_range(bounds)}, got {value!r}",
                                 params=() if prefix else (name,))

    @staticmethod
    def check_given(overrides: typing.Sequence[str] = (), **values) -> None:
        """An InputError when a value a command was given (its flags' ``values``, None: not given; its
        ``decode.KEY=VALUE`` ``overrides``) is unusable on its own (a wrong type, outside its range), before
        a model loads: each key alone, not against the model's other settings."""
        given = {name: value for name, value in values.items() if value is not None}
        DecodeConfig(**given).check_ranges()
        _set_decode_overrides(Config(), overrides)

    def ineffective(self) -> list[str]:
        """One line for each setting that does nothing with the others (a warning, not an error: a model
        folder's config may hold it).

        >>> DecodeConfig(temperature=0.5, length_normalization=0.7, length_penalty="none").ineffective()[0]
        'decode.temperature 0.5 does nothing: it applies to decode.method: sample, not beam'
        """
        out = []
        if self.method != "sample":
            defaults = DecodeConfig()
            for name in ("temperature", "sample_top_k", "sample_top_p", "seed"):
                if getattr(self, name) != getattr(defaults, name):
                    out.append(f"decode.{name} {getattr(self, name)} does nothing: it applies to decode.method: "
                               f"sample, not {self.method}")
        if self.diversity and (self.beam_groups == 1 or self.method != "beam"):
            out.append(f"decode.diversity {self.diversity:g} does nothing: it needs decode.beam_groups above 1 (and "
                       f"decode.method: beam), got {self.beam_groups} group(s) and {self.method}")
        if self.beam_groups > 1 and self.method != "beam":
            out.append(f"decode.beam_groups {self.beam_groups} does nothing: it applies to decode.method: beam, not "
                       f"{self.method}")
        if self.length_normalization and self.length_penalty == "none":
            out.append(f"decode.length_normalization (--length-normalization) {self.length_normalization:g} does "
                       "nothing with decode.length_penalty: none (use avg or gnmt)")
        elif self.length_normalization and self.method == "sample":
            out.append(f"decode.length_normalization (--length-normalization) {self.length_normalization:g} does "
                       "nothing with decode.method: sample (samples are ranked by their log-probability)")
        return out

    def with_overrides(self, overrides: typing.Sequence[str] = ()) -> "DecodeConfig":
        """A copy with ``decode.KEY=VALUE`` overrides (a command's ``--set``) applied and checked; an
        InputError for any other key."""
        config = Config(decode=dataclasses.replace(self, bad_endings=list(self.bad_endings)))
        _set_decode_overrides(config, overrides)
        return config.decode.check("decode.")

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

    def given(self, key: str) -> str | None:
        """Where ``key`` (``"data.captions_per_image"``) got its value when this config was loaded:
        ``"file"`` (a config file or one of its bases), ``"set"`` (an override), or None (its default)."""
        return getattr(self, "_given", {}).get(key)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "options"}


def keys_of(cls) -> list[str]:
    """The keys of a section dataclass (``ModelConfig``'s without its ``options``)."""
    return list(_fields(cls))


_SECTIONS = {name: f.default_factory for name, f in _fields(Config).items()}


def all_keys() -> list[str]:
    """Every key of the sections here (the decoders' own keys: ``captioning.model.all_keys``)."""
    return [f"{s}.{k}" for s, cls in _SECTIONS.items() for k in _fields(cls)]


@dataclass(frozen=True)
class Given:
    """A decoder option as ``--set`` gave it: text, parsed once the decoder's type for it is known (the
    same rules as every key's ``--set`` text)."""

    text: str

    def literal(self):
        """The value YAML would read from the text (``16`` → 16), what a config file written before the
        decoder typed it holds: it loads back as the same setting."""
        try:
            value = yaml.safe_load(self.text)
        except yaml.YAMLError:
            return self.text
        return value if isinstance(value, (bool, int, float, list)) and not (
            isinstance(value, float) and not math.isfinite(value)) else self.text


def _unknown(key: str, known: typing.Sequence[str] = ()) -> InputError:
    section, dot, _ = key.partition(".")
    sections = list(_SECTIONS)
    if not dot and section in sections:
        return InputError(f"config key {key!r} names a section: give section.key=value, e.g. {section}."
                          f"{next(iter(_fields(_SECTIONS[section])))}=...")
    if section not in sections:
        near = difflib.get_close_matches(section, sections, n=2, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        what = f"config section {section!r}" if not dot else f"config section {section!r} (in {key!r})"
        return InputError(f"unknown {what}; {hint}sections are {', '.join(sections)}")
    keys = list(known) or all_keys()
    near = difflib.get_close_matches(key, keys, n=4, cutoff=0.5) or [k for k in keys if k.startswith(section + ".")]
    return InputError(f"unknown config key {key!r}; did you mean {', '.join(near)}?")


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _convert(key: str, f: dataclasses.Field, kind, value, from_text: bool):
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
    if bounds and not _in_range(value, bounds):
        raise InputError(f"config key {key} must be {describe_range(bounds)}, got {value!r}")
    return value


def section_from(cls, values: dict, prefix: str, complete: bool = False, where: str = "config"):
    """An instance of the section dataclass ``cls`` from ``{name: value}`` (a value given with ``--set``
    is a :class:`Given`), every value converted and checked as its field declares, then the section's
    :meth:`Section.check`; InputError naming ``prefix + name`` otherwise. ``complete``: every field must
    be given (a saved config.yaml). Decoders' settings are read with this too (``captioning.model``)."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    out = cls()
    for name, value in values.items():
        if name not in fields:
            raise _unknown(prefix + str(name), [prefix + k for k in fields])
        text = isinstance(value, Given)
        setattr(out, name, _convert(prefix + name, fields[name], hints[name], value.text if text else value, text))
    if complete:
        missing = [prefix + k for k in fields if k not in values]
        if missing:
            raise InputError(f"{where} lacks {len(missing)} of its keys ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is cut short or damaged")
    if callable(getattr(out, "check", None)):  # a Section, or a decoder's settings that check themselves
        out.check(prefix)
    return out


def _set(config: Config, key: str, value, from_text: bool) -> None:
    section, dot, name = key.partition(".")
    if not dot or section not in _SECTIONS or (section != "model" and name not in _fields(_SECTIONS[section])):
        raise _unknown(key)
    target = getattr(config, section)
    if section == "model" and name not in _fields(ModelConfig):  # the decoder's: typed by the model stage
        if not name.isidentifier():
            raise _unknown(key)
        target.options[name] = Given(str(value)) if from_text else value
        return
    f = _fields(_SECTIONS[section])[name]
    setattr(target, name, _convert(key, f, typing.get_type_hints(_SECTIONS[section])[name], value, from_text))


def _set_section(config: Config, section: str, values, where: str, given: dict) -> None:
    if values is None:  # "train:" with nothing under it
        return
    if not isinstance(values, dict):
        raise InputError(f"{where}: section {section!r} must be a mapping of keys")
    for name, value in values.items():
        key = f"{section}.{name}"
        _set(config, key, value, from_text=False)
        given[key] = "file"


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


# ---- format versions -------------------------------------------------------------------------------------

def _from_format_1(data: dict) -> dict:
    """Format 1 (config.yaml without ``format_version``, written until November 2026): keys were added over
    time without a version, so an older file may lack the ones below; they get the default they had when
    they appeared. Every decoder's settings sat in ``model:`` whatever the decoder (``attention_size``
    and ``attention_l1`` in a Show-and-Tell folder too); format 2 keeps only the chosen decoder's."""
    added_later = {"distribute.peer_timeout_s": 30, "distribute.startup_timeout_s": 600,
                   "model.decoder": "show_and_tell", "decode.beam_size": 3, "decode.max_length": 20,
                   "decode.length_normalization": 0.0, "decode.top_k": 1, "train.jit_compile": False,
                   "train.split_padding": False, "data.group_captions": 0, "train.momentum": 0.0,
                   "model.attention_size": 512, "model.attention_l1": 1.0, "train.objective": "xe",
                   "scst.samples": 5, "scst.baseline": "mean", "scst.max_length": 16, "scst.temperature": 1.0,
                   "scst.end_in_reward": True, "data.service": "", "data.service_mode": "parallel_epochs",
                   "data.service_timeout_s": 60, "data.service_compression": "none",
                   # keys that came with format 2, at the values that reproduce format 1's behaviour
                   "train.label_smoothing": 0.0, "train.weight_decay": 0.01}
    out = {section: dict(values or {}) if isinstance(values, dict) else values for section, values in data.items()}
    for key, default in added_later.items():
        section, name = key.split(".")
        if isinstance(out.setdefault(section, {}), dict):
            out[section].setdefault(name, default)
    model = out.get("model")
    if isinstance(model, dict) and model.get("decoder") != "attention":
        model.pop("attention_size", None)
        model.pop("attention_l1", None)
    return out


def _from_format_2(data: dict) -> dict:
    """Format 3 brought region features (data.features, data.features_store, model.region_feature_size,
    model.box_geometry, model.regions_from_encoder) and the decoding options (decode.method, ...); a format-2
    model read images and decoded by plain beam search."""
    added = {"data.features": "images", "data.features_store": "regions", "model.region_feature_size": 0,
             "model.box_geometry": False, "model.regions_from_encoder": False, "decode.method": "beam",
             "decode.length_penalty": "avg", "decode.beam_groups": 1, "decode.diversity": 0.0,
             "decode.block_ngrams": 0, "decode.bad_endings": [],
             "decode.temperature": 1.0, "decode.sample_top_k": 0, "decode.sample_top_p": 1.0, "decode.seed": 0}
    out = {section: dict(values or {}) if isinstance(values, dict) else values for section, values in data.items()}
    for key, default in added.items():
        section, name = key.split(".")
        if isinstance(out.setdefault(section, {}), dict):
            out[section].setdefault(name, default)
    return out


def _from_format_3(data: dict) -> dict:
    """Format 4 brought train.steps_per_execution; a format-3 model ran one step per call."""
    out = {section: dict(values or {}) if isinstance(values, dict) else values for section, values in data.items()}
    if isinstance(out.setdefault("train", {}), dict):
        out["train"].setdefault("steps_per_execution", 1)
    return out


def _from_format_4(data: dict) -> dict:
    """Format 5 brought scst.xla_sampling; it draws the same samples as a format-4 model did, faster."""
    out = {section: dict(values or {}) if isinstance(values, dict) else values for section, values in data.items()}
    if isinstance(out.setdefault("scst", {}), dict):
        out["scst"].setdefault("xla_sampling", True)
    return out


# format N → N + 1; never edit one once released: a new format adds a function
MIGRATIONS: dict[int, typing.Callable[[dict], dict]] = {1: _from_format_1, 2: _from_format_2, 3: _from_format_3,
                                                        4: _from_format_4}


def migrate(data: dict, where: str) -> dict:
    """A saved config's mapping in the current format (see the module docstring)."""
    version = data.pop("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise InputError(f"{where} has format_version {excerpt(version)}; this code reads formats 1 to "
                         f"{FORMAT_VERSION}: it was written by a newer version of captioning, or is damaged")
    for step in range(version, FORMAT_VERSION):
        data = MIGRATIONS[step](data)
    return data


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), complete: bool = False) -> Config:
    """Defaults ← ``path`` and its bases ← ``overrides`` (``"section.key=value"`` strings).

    ``complete=True`` is for a config this project wrote with every key (a model folder's
    ``config.yaml``): an older format is migrated first (:data:`MIGRATIONS`), then a missing key means the
    file was cut short or damaged, an InputError naming it, instead of a silent default."""
    config = Config()
    given: dict[str, str] = {}
    for source, data in _read_yaml(path) if path else []:
        if complete:
            data = migrate(data, f"config {source}")
        else:
            data.pop("format_version", None)
        for section, values in data.items():
            if section not in _SECTIONS:
                raise _unknown(str(section))
            _set_section(config, section, values, f"config {source}", given)
    if complete:
        missing = [k for k in all_keys() if k not in given]
        if missing:
            raise InputError(f"config {path} lacks {len(missing)} of its keys ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is cut short or damaged")
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq:
            raise InputError(f"`overrides` {excerpt(override)} must look like section.key=value", params=("overrides",))
        _set(config, key.strip(), value, from_text=True)
        given[key.strip()] = "set"
    for name in _SECTIONS:
        getattr(config, name).check(f"{name}.")
    object.__setattr__(config, "_given", given)
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


def to_dict(config: Config) -> dict:
    """Every key, section by section; the decoder's own keys sit in ``model`` beside the shared ones."""
    out = {}
    for name in _SECTIONS:
        section = getattr(config, name)
        values = {k: getattr(section, k) for k in _fields(type(section))}
        for k, v in values.items():
            values[k] = list(v) if isinstance(v, list) else v
        if name == "model":
            values.update({k: v.literal() if isinstance(v, Given) else v for k, v in section.options.items()})
        out[name] = values
    return out


def from_dict(data: dict) -> Config:
    """The inverse of :func:`to_dict`, with the same checks as a YAML file."""
    config = Config()
    given: dict[str, str] = {}
    for section, values in data.items():
        if section not in _SECTIONS:
            raise _unknown(str(section))
        _set_section(config, section, values, "config", given)
    return config


def save_config(config: Config, path: str) -> None:
    """Writes the resolved config (every key, and the format version) as YAML, atomically."""
    atomic_write_text(path, yaml.safe_dump({"format_version": FORMAT_VERSION, **to_dict(config)}, sort_keys=False))


def validate(config: Config) -> None:
    """Checks that concern several sections at once (each section checks its own keys as it loads);
    raises InputError."""
    d, m = config.data, config.model
    if not d.dir:
        raise InputError("data.dir is not set: point it at a folder written by `captioning prepare`")
    if d.cache == "features" and (m.encoder_trainable or d.random_crop or d.random_flip or d.color_jitter):
        raise InputError("data.cache: features caches the frozen encoder's outputs, so it needs "
                         "model.encoder_trainable: false and data.random_crop, data.random_flip and "
                         "data.color_jitter all false")
    if m.box_geometry and d.features != "regions":
        raise InputError("model.box_geometry adds the regions' boxes to their features: it needs data.features: "
                         "regions")
    if m.region_feature_size and d.features != "regions":
        raise InputError(f"model.region_feature_size ({m.region_feature_size}) is the size of region features: "
                         "it needs data.features: regions")
    if config.train.steps_per_execution > 1 and d.service:
        raise InputError(f"train.steps_per_execution ({config.train.steps_per_execution}) reads the batches inside "
                         "the compiled call, where a stalled tf.data service cannot be watched: use 1 with "
                         "data.service")
    for name in _SECTIONS:
        getattr(config, name).check(f"{name}.")
