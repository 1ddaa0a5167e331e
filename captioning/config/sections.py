"""The sections every stage reads: ``data:``, ``train:``, ``distribute:`` and ``decode:``.

Each is a :class:`~captioning.config.settings.Section` dataclass: its fields are its keys, each with its
default, its type and its choices or range, and a comment saying what it does; :meth:`check` holds the
rules between its own keys. The config loader (:mod:`captioning.config`) reads them from YAML and
``--set``; :func:`captioning.config.validate` adds the rules that span sections.

They live here, beside the loader in the base, and not in the stage that uses each most, because the
loader must type and check them before TensorFlow loads (the data stage's modules, like every stage's
package, would bring it) and because several stages read each of them: ``data:`` the input, training,
evaluation and the features commands; ``decode:`` the model's beam search, captioning, evaluation and
export. A component's own settings live with the component instead: a decoder's in its module
(``model.*`` keys), a training objective's in its module (``scst:``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from captioning.errors import InputError, excerpt
from captioning.config.settings import (MAX_ACCUMULATE_STEPS, MAX_BATCH, MAX_BEAM, MAX_CPUS, MAX_DECODE_BATCH, MAX_EPOCHS,
                                 MAX_EVAL_BATCHES, MAX_FACTOR, MAX_GRADIENT_NORM, MAX_GROUP_CAPTIONS, MAX_IMAGE_SIZE, MAX_KEPT_CHECKPOINTS,
                                 MAX_LENGTH_NORMALIZATION, MAX_LENGTH_WINDOW, MAX_REGION_PAD_MULTIPLE, MAX_RESIZE_SIZE, MAX_SAMPLE_TOP_K,
                                 MAX_SECONDS, MAX_SHUFFLE_BUFFER, MAX_STEPS, MAX_STEPS_PER_EXECUTION, MAX_TEMPERATURE,
                                 MAX_WORDS, SEED, Section, between, choices, convert, describe_range, fields_of,
                                 in_range, more_than, type_hints, unknown_key)


@dataclass
class DataConfig(Section):
    dir: str = ""  # a folder written by `captioning prepare` (manifest.json, vocab.txt, shards)
    train_split: str = "train"
    eval_split: str = "val"
    # what the model reads of each image: images, the prepared JPEGs (decoded, resized, cropped); regions, the
    # region features of the features store data.features_store inside data.dir (`captioning features import` or
    # `extract`): no JPEG is decoded, each image brings its own number of regions, padded per batch with a
    # mask (captioning.data.region_input); the image augmentations and image sizes do not apply to them
    features: str = "images"  # a data source's name (captioning.model.data_sources.DATA_SOURCES: images, regions)
    features_store: str = "regions"  # data.features: regions — the store's name (DATA/features/NAME)
    # what turns captions into ids (captioning.data.tokenizers): words, the prepared dataset's vocabulary (the
    # records' caption/ids); preset, the decoder's language-model preset's own tokenizer, run inside the input
    # pipeline on the records' caption/text (the same prepared records serve both); auto, the decoder's own
    # (words for the decoders trained from scratch, the preset's for a decoder that reads a language model)
    tokenizer: str = field(default="auto", metadata=choices("auto", "words", "preset"))
    # data.features: regions — each batch's region count is rounded up to a multiple of this (masked), so a
    # compiled step sees few shapes (captioning.data.region_input); 1: the batch's largest
    region_pad_multiple: int = field(default=16, metadata=between(1, MAX_REGION_PAD_MULTIPLE))
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
    deterministic: bool = False  # fixed element order (slower): every run sees the same batches, a resumed one too
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
    # the shuffles' seed, and with each element's place in the stream its every random draw (data/seeds.py)
    seed: int = field(default=0, metadata=between(0, SEED.stop - 1))

    def check(self, prefix: str = "data.") -> None:
        if self.image_size > self.resize_size:
            raise InputError(f"{prefix}image_size ({self.image_size}) cannot exceed {prefix}resize_size "
                             f"({self.resize_size}): images are resized, then cropped")
        if self.group_captions and self.captions_per_image != "grouped":
            raise InputError(f"{prefix}group_captions ({self.group_captions}) applies to {prefix}captions_per_image: "
                             f"grouped, not {self.captions_per_image}")
        if list(self.bucket_boundaries) != sorted(set(self.bucket_boundaries)) or any(b < 1 for b in self.bucket_boundaries):
            raise InputError(f"{prefix}bucket_boundaries must be increasing positive lengths, got {self.bucket_boundaries}")
        if not self.service:
            return
        from captioning.config.addresses import parse_address

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
class ScheduledSamplingConfig(Section):
    """``train.scheduled_sampling``: teacher forcing feeds the decoder its own sampled previous word instead of the
    reference's with probability p (Bengio et al. 2015), rising with the optimizer steps ``s`` as in
    self-critical.pytorch: ``p = min(start + increase × floor(s / increase_every), max)``. self-critical.pytorch
    counts epochs and starts at 0 from an epoch it names; here the schedule counts optimizer steps from the first
    and ``start`` is its first probability. ``max: 0`` (the default) turns it off; only a decoder whose
    teacher-forced pass runs word by word takes it (the recurrent ones), another is refused in one line.

    >>> ScheduledSamplingConfig(start=0.0, increase=0.05, increase_every=500, max=0.25).probability(1200)
    0.1
    """

    start: float = field(default=0.0, metadata=between(0.0, 1.0))
    increase: float = field(default=0.05, metadata=between(0.0, 1.0))  # self-critical.pytorch's increase_prob
    increase_every: int = field(default=5000, metadata=between(1, MAX_STEPS))  # optimizer steps
    max: float = field(default=0.0, metadata=between(0.0, 1.0))  # self-critical.pytorch's max_prob (0.25 there)

    @property
    def enabled(self) -> bool:
        return self.max > 0

    def probability(self, step: int) -> float:
        """The probability at optimizer step ``step`` (0 when off)."""
        if not self.enabled:
            return 0.0
        return round(min(self.start + self.increase * (step // self.increase_every), self.max), 12)

    def check(self, prefix: str = "train.scheduled_sampling.") -> None:
        if self.start > self.max and (self.max > 0 or self.start > 0):
            raise InputError(f"{prefix}start ({self.start}) is above {prefix}max ({self.max}): the probability "
                             f"rises from start to max (max: 0 turns scheduled sampling off)")


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
    # model.lm_trainable or model.lm_lora_rank (prefix_lm): the language model's learning rate (its weights or its
    # LoRA adapters) is this times the mapper's; 1: the same
    lm_lr_scale: float = field(default=1.0, metadata=between(0.0, 100.0, low_open=True))
    # sgd: heavy-ball momentum (0: plain SGD, the paper's and im2txt's)
    momentum: float = field(default=0.0, metadata=between(0.0, 1.0, high_open=True))
    # each variable's update as TensorFlow's one fused kernel (ResourceApplyAdam, ...: tf.keras 2's), with Keras'
    # slots and formula; false: Keras 3's element-wise update, bit for bit (captioning/train/optimizer.py)
    fused_updates: bool = True
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
    # an exponential moving average of the trainable weights, as Keras' use_ema/ema_momentum: after each optimizer
    # step ema = decay × ema + (1 − decay) × weight (starting from the weights); kept in the checkpoint beside
    # them and used by evaluate, caption and export unless they are given --weights raw; 0: none
    ema_decay: float = field(default=0.0, metadata=between(0.0, 1.0, high_open=True))
    # micro-batches per optimizer step: each a batch of train.batch_size (global) examples, their gradients summed
    # and the update that of one batch this many times larger; train.steps, the logs and the learning-rate schedule count
    # optimizer steps
    accumulate_steps: int = field(default=1, metadata=between(1, MAX_ACCUMULATE_STEPS))
    # the decoder fed its own samples while teacher-forced (ScheduledSamplingConfig)
    scheduled_sampling: ScheduledSamplingConfig = field(default_factory=ScheduledSamplingConfig)

    def check(self, prefix: str = "train.") -> None:
        self.scheduled_sampling.check(f"{prefix}scheduled_sampling.")
        if self.lr_schedule == "noam" and self.warmup_steps < 1:
            raise InputError(f"{prefix}lr_schedule: noam rises over {prefix}warmup_steps, which must be at least 1, "
                             f"got {self.warmup_steps}")
        steps = self.profile_steps
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise InputError(f"{prefix}profile_steps must be [start, stop] with 1 <= start <= stop, got {steps}")



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
    # greedy: the search loop (the decoder's steps and the choices) compiled by XLA, a program per batch size
    # (captioning.model.search_loop.search); off by default. Beam search (its captions grow a word a step) and
    # sampling (its draws hash text) cannot be compiled
    jit_compile: bool = False

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
        if self.jit_compile and (self.method == "sample" or self.method == "beam" and self.beam_size > 1):
            j = prefix + "jit_compile" if prefix else "`jit_compile`"
            raise InputError(f"{j} compiles greedy decoding only (beam search's captions grow a word a step and "
                             f"sampling's draws hash text, which XLA cannot compile): use {prefix or ''}method greedy "
                             f"or {b} 1, or set {j} false", params=params + (() if prefix else ("jit_compile",)))
        return self

    def check_ranges(self, prefix: str = "") -> None:
        """An InputError naming the first setting outside its range (the sizes' upper bounds among them), as
        loading a config checks them; settings given as flags (:meth:`override`) are checked here too."""
        for name, f in fields_of(DecodeConfig).items():
            bounds = f.metadata.get("range")
            value = getattr(self, name)
            if bounds and not in_range(value, bounds):
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
        _set_decode_overrides(DecodeConfig(), overrides)

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
        decode = dataclasses.replace(self, bad_endings=list(self.bad_endings))
        _set_decode_overrides(decode, overrides)
        return decode.check("decode.")

    def override(self, **values) -> "DecodeConfig":
        """A copy with the values that are not None replaced (a command's flags), checked."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None}).check()



def _set_decode_overrides(decode: DecodeConfig, overrides: typing.Sequence[str]) -> None:
    """``decode.KEY=VALUE`` overrides (a command's ``--set``) set on ``decode``, each typed and range-checked
    alone; an InputError for any other key."""
    fields, hints = fields_of(DecodeConfig), type_hints(DecodeConfig)
    for override in overrides:
        key, eq, value = override.partition("=")
        key = key.strip()
        if not eq or not key.startswith("decode."):
            raise InputError(f"`overrides` {excerpt(override)} must look like decode.KEY=VALUE (only the decode: "
                             "section can change here)", params=("overrides",))
        name = key.removeprefix("decode.")
        if name not in fields:
            raise unknown_key(key, [f"decode.{k}" for k in fields])
        setattr(decode, name, convert(key, fields[name], hints[name], value, from_text=True))
