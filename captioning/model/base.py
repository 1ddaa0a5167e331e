"""The decoder interface: what beam search, training, evaluation and export know of a captioning model.

A captioning model is an encoder (:mod:`captioning.model.encoders`, built once and handed to the decoder) and
a decoder. Everything outside
this package uses only these methods, so a new decoder is a new module with a :class:`CaptionModel`
subclass, plus its name in :data:`captioning.model.DECODERS`::

    features = model.encode(images, training)        pixels [B, S, S, 3] → features [B, D] or tokens [B, N, D]
    state = model.initial_state(features, training, mask)   a nest of batch-major tensors [B, ...]
    features, mask = model.image_features(inputs, training)  what a batch's images give: encoded pixels,
                                                     cached features, or regions and their mask
    state = model.reserve(state, steps)               room for `steps` calls of step (default: as it is)
    logits, state = model.step(token_ids, state)      one word: ids [B] → logits [B, V] (float32)
    logits, state = model.teacher_forced(state, input_ids, training)  a caption from a state: [B, T, V]
    logits = model({"image" or "features", "input_ids"}, training)    teacher forcing: [B, T, V]
    logits = model({"image" [B, ...], "image_index" [N], "input_ids" [N, T]})    grouped captions: [N, T, V]

With ``image_index`` (``data.captions_per_image: grouped``), row ``i`` of the captions belongs to image
``image_index[i]``: the images are encoded once, each image's initial decoding state computed once (a
Transformer's encoder layers, an attention decoder's projection of the grid) and gathered per caption,
which equals encoding each caption's copy of its image (gradients add up over an image's captions) —
apart from batch-norm batch statistics of a trainable encoder, which then see each image once instead of
once per caption, and from dropout in the initial state, whose mask an image's captions then share.

The state may hold anything a decoding step needs per sequence (an LSTM's ``h`` and ``c``, an attention
grid): beam search repeats every tensor of it per beam and reorders them all when beams are re-ranked,
so a decoder never sees the search. ``call`` must equal stepping through the caption word by word
(the tests check it for every decoder).

**Split padding** (``model(..., split_padding=True)``, ``train.split_padding``). A batch pads every caption
to its longest, and the padded steps cost as much as real ones. With ``split_padding`` the teacher-forced
pass runs in two pieces of time: every caption up to a cut, then only the captions still going, from
their state at the cut. :func:`split_point` picks the cut per batch to compute the fewest steps::

    lengths 6 6 3 2 (input ids, <start> included), padded to 6 steps
    one piece:  4 captions × 6 steps                   = 24 steps computed for 17 real ones (0.71)
    split at 3: 4 captions × 3 steps + 2 captions × 3 = 18 steps computed                  (0.94)

The logits are the same (padded positions, which the loss masks, come out as zeros). Grouped batches
(whole images with all their captions) gain the most: an image's captions differ in length.

**Regions** (``data.features: regions``, the model's data source :mod:`captioning.model.data_sources.regions`,
``model.source``): the decoder reads each image's
regions ``[B, N, D]`` from the batch (``regions``, ``boxes``, ``region_mask``; padded per batch) instead of
the encoder's grid, and :meth:`CaptionModel.image_features` gives them with their ``mask [B, N]`` (1 for
a region, 0 for padding). A decoder reading a grid takes them as its cells and must respect the mask:
no attention weight and no share of a mean on padding (the contract tests pad a batch with extra
regions and compare); a decoder reading pooled features gets their masked mean. With
``model.box_geometry`` each region's box is appended to its features (x1, y1, x2, y2 and area, fractions
of the image: self-critical.pytorch's ``use_box``). The encoder is still built (and checkpointed): it is
what extracts regions from new images.

**Empty batches** are legal: under a distribution strategy the last batch of a split that does not
divide by the replicas leaves some replica with no example (images ``[0, S, S, 3]``, input_ids ``[0,
0]``). Keras' LSTM raises on zero rows or zero time steps and TensorFlow's convolutions mis-shape an
empty batch, so :meth:`CaptionModel.encode` and :meth:`CaptionModel.call` run the encoder and decoder
on at least one row and one step of zero padding and cut the result back: an empty batch gives logits
``[0, 0, V]``, zero loss and zero gradients, never an error. (In training mode a padded row would enter
batch-norm statistics, which is why training input pipelines never yield an empty batch.) Decoders
implement :meth:`CaptionModel.teacher_forced` and get this, and split padding, for free.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.model.encoders.base import ImageEncoder, NoSettings
from captioning.model.layout import TokenLayout
from captioning.model.scheduled_sampling import mixed_teacher_forced
from captioning.vocab import PAD_ID


GEOMETRY = 5  # features model.box_geometry adds to a region
IMAGE_INPUTS = ("image", "features", "regions", "boxes", "region_mask")  # what a batch's images give the model


def box_geometry(boxes):
    """Boxes ``[..., 4]`` (x1, y1, x2, y2 as fractions of the image) → ``[..., 5]``: the four and the box's
    area as a fraction of the image's (self-critical.pytorch's ``use_box``); an inverted box (which the
    stores' rule, ``clean_boxes``, never keeps) has no area, not a positive one.

    >>> box_geometry(tf.constant([[0.0, 0.5, 0.5, 1.0], [0.5, 0.5, 0.25, 0.25]])).numpy().tolist()
    [[0.0, 0.5, 0.5, 1.0, 0.25], [0.5, 0.5, 0.25, 0.25, 0.0]]
    """
    boxes = tf.cast(boxes, tf.float32)
    area = tf.nn.relu(boxes[..., 2] - boxes[..., 0]) * tf.nn.relu(boxes[..., 3] - boxes[..., 1])
    return tf.concat([boxes, area[..., None]], axis=-1)


def masked_mean(features, mask):
    """The mean of ``features [B, N, D]`` over the cells where ``mask [B, N]`` is 1 (None: all of them); zeros
    for a row with none."""
    if mask is None:
        return tf.reduce_mean(features, axis=1)
    weights = tf.cast(mask, features.dtype)[..., None]
    count = tf.maximum(tf.reduce_sum(weights, axis=1), tf.cast(1, features.dtype))
    return tf.reduce_sum(features * weights, axis=1) / count


def masked_scores(scores, mask):
    """Attention scores ``[B, N]`` (float32) with the cells where ``mask`` is 0 pushed to -1e9 (None: as they are)."""
    return scores if mask is None else scores + (1.0 - tf.cast(mask, scores.dtype)) * -1e9


def pad_rows(x, rows):
    """``x`` with zero rows appended along axis 0 up to ``rows``, its other dimensions' static sizes kept (a
    convolution that cannot see its input's channels is compiled with XLA by Keras, once per batch shape)."""
    extra = tf.maximum(rows - tf.shape(x)[0], 0)
    out = tf.pad(x, tf.concat([[[0, extra]], tf.zeros([tf.rank(x) - 1, 2], tf.int32)], axis=0))
    shape = tf.TensorShape(x.shape)  # (numpy arrays too)
    out.set_shape(tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else None)
    return out


def _fit(x, like):
    """``x`` padded with zeros to ``like``'s shape on every axis but the first."""
    extra = tf.maximum(tf.shape(like)[1:] - tf.shape(x)[1:], 0)
    return tf.pad(x, tf.concat([[[0, 0]], tf.stack([tf.zeros_like(extra), extra], axis=1)], axis=0))


def split_point(lengths, steps):
    """The cut (1 ≤ cut ≤ ``steps``) that minimises the steps computed when every caption runs to the cut
    and only the captions longer than it run on: ``rows × cut + longer × (steps − cut)``; the earliest of
    equal ones.

    >>> int(split_point(tf.constant([6, 6, 3, 2]), 6)), int(split_point(tf.constant([4, 4]), 4))
    (3, 1)
    """
    lengths = tf.cast(lengths, tf.int32)
    cuts = tf.range(1, steps + 1)
    longer = tf.reduce_sum(tf.cast(lengths[None, :] > cuts[:, None], tf.int32), axis=1)
    computed = tf.size(lengths) * cuts + longer * (steps - cuts)
    return tf.cast(tf.argmin(computed), tf.int32) + 1


class _Weights(tf.Module):
    """Variables by their index, for a checkpoint: what it saves of an encoder whose layers keep some of their
    sublayers where TensorFlow's checkpoint tracking does not look (keras-hub's ViT keeps its Transformer blocks
    in a plain list), which a checkpoint of the model alone would silently leave out."""

    def __init__(self, variables):
        super().__init__(name="encoder_weights")
        self.by_index = {f"w{i:04d}": v for i, v in enumerate(variables)}


def untracked(model) -> list:
    """The weights of Keras ``model`` that TensorFlow's checkpoint tracking does not reach from it."""
    reached = {id(t) for t in tf.train.TrackableView(model).descendants()}
    return [v for v in model.weights if id(v) not in reached and id(getattr(v, "value", v)) not in reached]


class CaptionModel(keras.Model):
    """Base class of every captioning model (see the module docstring).

    A subclass declares what the rest of the code asks about it, as class attributes:

    * :attr:`settings_class` — a dataclass of its own settings (``model.<name>`` keys in a config; each
      field with its default, type and range in the field's metadata, as config sections declare them);
    * :attr:`incompatible_keys` — which of those settings change its variables' shapes (a model folder
      refuses a config that changes them);
    * :attr:`features` — ``"pooled"`` (``[B, D]``) or ``"grid"`` (``[B, cells, D]``, read cell by cell:
      its variables do not depend on the grid's size);
    * :attr:`tiny_settings` — settings small enough for a model that builds and steps on a CPU in a
      second (tests/test_decoders.py runs every decoder's contract with them);
    * :attr:`attends` — whether its decoding step reports attention weights over the token set: its state
      is then a dict whose ``attention`` entry holds the step's weights ``[B, tokens]`` (or regions); where
      the tokens sit is :attr:`token_layout` (the encoder's; None for regions, or an encoder without one);
    * :attr:`fast_teacher_forcing` — whether its teacher-forced pass over a caption costs less than stepping
      through it word by word (a Transformer's runs the words in parallel; a recurrent decoder's is a loop
      too): self-critical training then draws its samples without gradient and scores them in one
      teacher-forced pass, instead of differentiating through the sampling loop;
    * :attr:`scheduled_sampling` — whether its teacher-forced pass can feed it its own sampled previous words
      (``train.scheduled_sampling``, :mod:`captioning.model.scheduled_sampling`): true for a decoder whose
      :meth:`step` in training mode is its teacher-forced pass one word at a time (the recurrent ones); a
      Transformer's reads every word at once and is refused the setting before a run starts;
    * :meth:`max_caption_length` — the most words it can decode with given settings (None: no bound; the
      Transformer's is ``model.max_positions``, named by :attr:`caption_length_setting`): ``decode.max_length``
      and ``scst.max_length`` are checked against it before a command starts
      (:func:`captioning.model.check_caption_length`);
    * :attr:`own_encoder` — the encoder of its own it reads images with (``vlm``'s), refusing others; None: any;
    * :meth:`tokenizer_preset` — the keras-hub preset whose tokenizer its captions are written in (None: the
      prepared dataset's word vocabulary, the default): ``data.tokenizer: auto`` follows it, and ``words`` or
      ``preset`` against it is refused (:func:`captioning.data.tokenizers.choose`);

    and its constructor ``(vocab_size, cfg: ModelConfig, encoder: ImageEncoder, seed=0, settings=None, **kwargs)``
    hands ``kwargs`` (``source``, the data source it reads) to this class's and calls :meth:`setup` first, which
    keeps the built encoder it is handed (:func:`captioning.model.build_model` builds it, pooled or as tokens as
    :attr:`features` asks: no decoder builds one) as :attr:`encoder` (its Keras model from pixels to features), and
    implements :meth:`initial_state`, :meth:`step`, :meth:`teacher_forced` and :meth:`decoder_variables`. Beam
    search, captions, export, TensorBoard pictures and grounding show an attending decoder's weights."""

    settings_class: type = NoSettings
    incompatible_keys: tuple[str, ...] = ()
    features: str = "pooled"
    attends: bool = False
    fast_teacher_forcing: bool = True
    scheduled_sampling: bool = False
    tiny_settings: dict = {}
    own_encoder: str | None = None
    token_layout: TokenLayout | None = None
    caption_length_setting: str | None = None  # the setting that bounds max_caption_length (a refusal names it)

    vocab_size: int
    image_size: int
    cfg: ModelConfig

    def __init__(self, source=None, **kwargs):
        """``source``: the data source the model reads (:mod:`captioning.model.data_sources`; default: the
        images), handed on by a decoder's constructor with its other keyword arguments
        (:func:`captioning.model.build_model` gives it)."""
        super().__init__(**kwargs)
        if source is None:
            from captioning.model.data_sources.images import Images

            source = Images()
        self.source = source

    def setup(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, settings=None):
        """Records the model's sizes, config and encoder; ``settings`` (an instance of :attr:`settings_class`)
        default to ``cfg.decoder_settings`` (typed by :func:`captioning.model.typed_model`). Sets :attr:`encoder`
        (the encoder's Keras model: the checkpoints' ``model/encoder``), :attr:`grid_cells` (its tokens), :attr:`feature_size`
        (the depth of what the decoder reads) and :attr:`token_layout`."""
        self.vocab_size, self.cfg, self.image_size = vocab_size, cfg, encoder.image_size
        self.settings = settings if settings is not None else cfg.decoder_settings
        self.image_encoder = encoder
        self.encoder = encoder.model
        self.grid_cells = encoder.tokens
        self.feature_size = self.source.feature_depth(encoder.depth)
        self.token_layout = self.source.token_layout(encoder)
        if untracked(self.encoder):  # then the checkpoint holds all of the encoder's weights by index as well
            self.encoder_weights = _Weights(self.encoder.weights)

    @classmethod
    def max_caption_length(cls, settings) -> int | None:
        """The most words a caption decoded with ``settings`` (an instance of :attr:`settings_class`) may have
        — the steps beam search and sampling may take —, or None for no bound (the default: a recurrent
        decoder's state is the same size at any length)."""
        return None

    @classmethod
    def tokenizer_preset(cls, settings) -> str | None:
        """The keras-hub preset (a folder or a name) whose tokenizer a decoder of ``settings`` (an instance of
        :attr:`settings_class`) reads and writes captions in, or None: the prepared dataset's word vocabulary
        (the default; every decoder trained from scratch)."""
        return None

    def encode(self, images, training=False):
        """Pixels ``[B, S, S, 3]`` → the features this decoder reads; ``[0, ...]`` for an empty batch."""
        rows = tf.shape(images)[0]
        return self.encoder(pad_rows(images, 1), training=training)[:rows]

    def initial_state(self, features, training=False, mask=None):
        """The decoding state of each image before its first word, from its features ``[B, ...]``; ``mask
        [B, cells]`` (float, 1 where a cell or region is real; None: all are) for a grid decoder."""
        raise NotImplementedError

    def image_features(self, inputs, training=False):
        """What the batch's images give the decoder: ``(features, mask)``. Pixels (``image``) are encoded,
        cached features (``features``, float16) cast back; regions (``regions [B, N, D]``, ``boxes``,
        ``region_mask``) come with their mask ``[B, N]`` (at least one column: a batch of no image has
        one of padding), their box geometry appended with ``model.box_geometry``, and as their masked mean
        for a decoder of pooled features. ``mask`` is None where every cell is real."""
        if "regions" not in inputs:
            if "features" in inputs:  # cached (float16 on disk, cast back here, on the device)
                return tf.cast(inputs["features"], self.compute_dtype), None
            return self.encode(inputs["image"], training), None
        regions = tf.cast(inputs["regions"], self.compute_dtype)
        mask = tf.cast(inputs["region_mask"], tf.float32)
        if self.cfg.box_geometry:
            regions = tf.concat([regions, tf.cast(box_geometry(inputs["boxes"]), regions.dtype)], axis=-1)
        extra = tf.maximum(1 - tf.shape(mask)[1], 0)  # at least one region column (masked out)
        regions = tf.pad(regions, [[0, 0], [0, extra], [0, 0]])
        mask = tf.pad(mask, [[0, 0], [0, extra]])
        if self.features == "pooled":
            return masked_mean(regions, mask), None
        return regions, mask

    def reserve(self, state, steps):
        """The ``state`` readied for :meth:`step` to be called up to ``steps`` times (beam search and sampling
        call it first): a decoder that caches each word's keys and values allocates room for them here.
        The default returns the state as it is."""
        return state

    def step(self, token_ids, state, training=False):
        """One decoding step: ``token_ids [B]`` and the state → ``logits [B, V]`` (float32) and the new state.
        ``training``: with the dropout of the teacher-forced pass (scheduled sampling's steps, asked only of a
        decoder whose :attr:`scheduled_sampling` is true; decoding: never)."""
        raise NotImplementedError

    def teacher_forced(self, state, input_ids, training=False):
        """Teacher-forced logits ``[B, T, V]`` (float32) of ``input_ids [B, T]`` read from ``state``, and the
        state after the last of them; a batch with at least one row and one step."""
        raise NotImplementedError

    def forward(self, features, input_ids, training=False):
        """Teacher-forced logits ``[B, T, V]`` and the state after the last step, for a batch with at least
        one row and one step."""
        return self.teacher_forced(self.initial_state(features, training), input_ids, training)

    def split_teacher_forced(self, state, input_ids, training=False):
        """:meth:`teacher_forced` in two pieces of time (see the module docstring: split padding). The state
        returned is each caption's after its own last piece."""
        rows, steps = tf.shape(input_ids)[0], tf.shape(input_ids)[1]
        lengths = tf.reduce_sum(tf.cast(tf.not_equal(input_ids, PAD_ID), tf.int32), axis=1)
        cut = split_point(lengths, steps)
        order = tf.argsort(lengths, direction="DESCENDING", stable=True)  # the longer captions first
        state = tf.nest.map_structure(lambda s: tf.gather(s, order), state)
        input_ids = tf.gather(input_ids, order)
        first, at_cut = self.teacher_forced(state, input_ids[:, :cut], training)
        going = tf.reduce_sum(tf.cast(lengths > cut, tf.int32))  # the first `going` rows run on
        # at least one row and one step, like every batch (zeros, cut away again)
        state = tf.nest.map_structure(lambda s: pad_rows(s[:going], 1), at_cut)
        rest = input_ids[:going, cut:]
        rest = tf.pad(rest, [[0, tf.maximum(1 - going, 0)], [0, tf.maximum(1 - (steps - cut), 0)]])
        second, after = self.teacher_forced(state, rest, training)
        second = pad_rows(second[:going, :steps - cut], rows)  # the finished captions' steps: zeros
        logits = tf.concat([first, tf.cast(second, first.dtype)], axis=1)
        unsort = tf.math.invert_permutation(order)
        # the captions that ended at the cut keep their state there; a state that grew over the second piece
        # (a Transformer's cache) is padded with zeros to the longer one's shape
        final = tf.nest.map_structure(lambda a, b: tf.gather(tf.concat([b[:going], _fit(a[going:], b)], 0), unsort),
                                      at_cut, after)
        return tf.gather(logits, unsort), final

    def penalty(self, state):
        """A per-caption term ``[B]`` the training loss adds to each caption's summed cross-entropy, from
        the state after its teacher-forced pass (the attention decoder's doubly stochastic
        regularisation); None for none."""
        return None

    def decoder_variables(self) -> list:
        """The decoder's variables (everything but the encoder's)."""
        raise NotImplementedError

    def lm_variables(self) -> list:
        """The trainable variables of a pretrained language model inside the decoder (``prefix_lm``'s, fine-tuned
        or its LoRA adapters), which learn at ``train.lm_lr_scale`` times the rate; none for a decoder trained from
        scratch (the default)."""
        return []

    @classmethod
    def mixed_precision(cls, settings) -> bool:  # in mixed precision whatever train.mixed_precision says (vlm's)
        return False

    def lora_backbone(self):  # the keras-hub backbone whose LoRA adapters it trains (export --merge-lora), or None
        return None

    def image_state(self, inputs, training=False):
        """The decoding state of each image of a batch (``image``, ``features`` or regions: as
        :meth:`image_features` reads them) before its first word: what beam search starts from."""
        features, mask = self.image_features(inputs, training)
        return self.initial_state(features, training, mask=mask)

    def logits_and_penalty(self, inputs, training=False, split_padding=False, sampling=None):
        """Teacher-forced logits ``[N, T, V]`` and :meth:`penalty` per caption ``[N]`` (zeros for a
        decoder without one) for ``inputs`` as :meth:`call` takes them. ``sampling``: ``(probability, seed)``
        of scheduled sampling (:func:`~captioning.model.scheduled_sampling.mixed_teacher_forced`, word by word:
        split padding does not shorten it; a decoder whose :attr:`scheduled_sampling` is false refuses it)."""
        features, mask = self.image_features(inputs, training)
        # each image's state once (at least one row: a decoder never sees an empty batch) ...
        state = self.initial_state(pad_rows(features, 1), training,
                                   mask=None if mask is None else pad_rows(mask, 1))
        if "image_index" in inputs:  # ... then per caption (grouped captions: the images' states gathered)
            state = tf.nest.map_structure(lambda s: tf.gather(s, inputs["image_index"]), state)
        input_ids = inputs["input_ids"]
        rows, steps = tf.shape(input_ids)[0], tf.shape(input_ids)[1]
        state = tf.nest.map_structure(lambda s: pad_rows(s, tf.maximum(rows, 1))[:tf.maximum(rows, 1)], state)
        input_ids = tf.pad(input_ids, [[0, tf.maximum(1 - rows, 0)], [0, tf.maximum(1 - steps, 0)]])
        if sampling is not None:
            if not self.scheduled_sampling:
                raise ValueError(f"{type(self).__name__} does not take scheduled sampling")
            logits, state = mixed_teacher_forced(self, state, input_ids, *sampling, training=training)[:2]
        else:
            forward = self.split_teacher_forced if split_padding else self.teacher_forced
            logits, state = forward(state, input_ids, training=training)
        penalty = self.penalty(state)
        penalty = tf.zeros([rows]) if penalty is None else tf.cast(penalty, tf.float32)[:rows]
        return logits[:rows, :steps], penalty

    def call(self, inputs, training=False, split_padding=False):
        return self.logits_and_penalty(inputs, training=training, split_padding=split_padding)[0]

    def build(self, input_shape=None):
        """Nothing to create here: the sublayers build on their first call (:meth:`build_all`). (Without this, Keras
        builds a model on its first call by tracing that call symbolically first, then runs it: the model's whole
        forward pass traced once for nothing, about half of what building costs.)"""
        self.built = True

    def build_all(self) -> "CaptionModel":
        """Creates every variable (encoder and decoder) with one tiny forward pass over the inputs its data source
        gives (:meth:`~captioning.model.data_sources.base.DataSource.probe_inputs`); a model whose inputs hold no
        image runs its encoder once more (it extracts the regions of new images)."""
        inputs = self.source.probe_inputs(self.image_size)
        if "image" not in inputs:
            self.encode(np.zeros((1, self.image_size, self.image_size, 3), "uint8"))
        self({**inputs, "input_ids": np.zeros((1, 1), "int64")})
        return self
