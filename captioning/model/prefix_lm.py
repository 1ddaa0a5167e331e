"""``model.decoder: prefix_lm``: a pretrained causal language model decodes, fed a visual prefix (ClipCap, Mokady
et al. 2021; BLIP-2, Li et al. 2023; PaliGemma and LLaVA prepend projected image tokens the same way).

The encoder's tokens ``[B, N, D]`` (``features = "grid"``; regions and their mask alike) go through the mapping
network ``model.mapper`` (:mod:`captioning.model.mappers`: ClipCap's MLP or Transformer, BLIP-2's Q-Former) into
``L`` prefix vectors of the LM's width (``model.prefix_length``; the Q-Former's ``model.query_tokens``). The LM
(``model.decoder_preset``: a keras-hub preset folder, as ``captioning lm train`` or ``save_to_preset`` writes
it, or a preset name; loaded with ``Backbone.from_preset`` under the run's precision policy, adapted by
:mod:`captioning.model.language_models`) reads one causal sequence::

    [ prefix vectors (L) | the prompt's pieces, embedded (m) | the caption's pieces, embedded ]
      positions 0 … L−1    L … P−1 (P = L + m)                  P …  (the first word's logits: P − 1's output)

The prompt (``model.prompt``, e.g. "a picture of", BLIP's) is tokenized once, at construction, by the preset's
own tokenizer (without start or end tokens). Attention is causal over everything (the LM is causal; ClipCap and
BLIP-2 do the same): the prefix sees itself, the caption sees the prefix, the prompt and its own earlier pieces.

**Ids** (the tokenizer's rule, :mod:`captioning.data.tokenizers`): the LM's token ``i`` is project id ``i + 4``;
ids 0–3 (``<pad>``, ``<start>``, ``<end>``, ``<unk>``) are the project's. The logits ``[B, V]`` (float32) are the
LM's: column ``i + 4`` is LM token ``i``'s logit; ``<end>``'s is the LM's end token's; ``<pad>``, ``<start>``,
``<unk>`` and the project ids of the LM's own special tokens (its start, end, padding, unknown...) get -1e9, so
they are never proposed (``<end>`` stands for the end token). ``V`` is the model's ``vocab_size`` (the tokenizer's:
4 + its vocabulary); an LM whose embedding has more rows than its tokenizer has pieces (padded for speed, as
Qwen's) has those rows' logits left out. As inputs, ``<pad>``, ``<end>`` and ``<unk>`` read the LM's end token
(only padding after a caption's end sees them, which nothing earlier attends to).

**``<start>`` feeds nothing extra.** The initial state runs the LM over the prefix and prompt *but their last
vector* (positions 0 … P−2, cached) and keeps that last vector as ``pending``; reading ``<start>`` means reading
``pending`` at position P−1, whose output gives the first word's logits. Word ``n`` of a caption (``<start>`` is
word 0) is read at position ``P − 1 + n``. So one position computes the first word, exactly as a prefix LM would
without a start token, and stepping equals the full pass.

**State and cache.** ``{"cache": [B, layers, 2, S, kv_heads, head_dim], "pending": [B, width], "t": [B]}``: the
LM's keys and values of positions ``0 … t−1`` (one tensor for every family; Gemma 3's tuples are split from it),
computed once per image in :meth:`PrefixLM.initial_state` (``t = P − 1``), repeated per beam by the search.
:meth:`PrefixLM.reserve` pads the cache to ``t + steps`` slots (zeros, masked by the causal mask);
:meth:`PrefixLM.step` writes one piece's keys and values at ``t`` (a step with no slot left is an error);
:meth:`PrefixLM.teacher_forced` writes ``T`` pieces at ``t … t + T − 1`` at once (the cache grown to fit), from
any state, so stepping on from it equals the full pass (the contract tests: 1e-5). Every row of a state is at the
same ``t`` (keras-hub's cache index is one scalar): the largest is read (a row of zero padding has 0).

**Bounds.** GPT-2's learned positions stop at its ``max_sequence_length``:
:meth:`PrefixLM.max_caption_length` is ``max_sequence_length − P + 1`` words (decoding ``n`` words reads
positions ``P − 1 … P + n − 2``; read from the preset folder's ``config.json``, and its tokenizer when there is a
prompt; a training caption longer than that reads GPT-2's last position for the pieces past it, as the
Transformer decoder does past its ``max_positions``). Rotary families (Gemma, Llama, Qwen, SmolLM3) have no hard
bound: None (past the length they were trained on their quality drops; nothing fails). A preset *name* is not
read before the model is built: None as well.

**Training.** The LM is frozen by default (ClipCap's frozen variant: only the mapper trains) and then runs in
inference mode (no dropout, as ClipCap puts a frozen GPT-2 in eval mode); ``model.lm_trainable: true`` fine-tunes it
at ``train.lm_lr_scale`` times the learning rate; ``model.lm_lora_rank: R`` trains rank-``R`` LoRA adapters of its
attention's query and value projections instead (keras-hub's ``Backbone.enable_lora``: every other LM weight
frozen, the adapted projections' biases too, which Keras' LoRA leaves trainable); the two together are refused. :meth:`PrefixLM.decoder_variables` is every variable but the encoder's (the
LM's too, trained or not). The checkpoints hold the LM's weights (``model/backbone/...``, and by index those
TensorFlow's tracking does not reach): rebuilding a folder reads the preset's architecture and tokenizer, the
checkpoint brings the weights. ``model.decoder_preset`` is not among :attr:`PrefixLM.incompatible_keys`: another
preset of the same architecture fits the checkpoint (and its weights are replaced by the checkpoint's), one of other
shapes is refused by the restore's shape check; a tokenizer that differs is the tokenizer's check.

**Attention shown**: none (``attends`` is false): keras-hub's attention layers do not return their weights.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.config.settings import MAX_HEADS, MAX_LAYERS, between, choices
from captioning.data.tokenizers.preset import PresetTokenizer
from captioning.errors import InputError
from captioning.model.base import CaptionModel, _Weights, untracked
from captioning.model.encoders.base import ImageEncoder
from captioning.model.encoders.keras_hub import check_preset_folder, load_backbone
from captioning.model.language_models import adapter
from captioning.model.lora import adapted_layers
from captioning.model.mappers import MAPPERS
from captioning.vocab import END_ID, START_ID

OFFSET = 4  # the LM's token i is project id i + 4 (the project's reserved ids first)
MAX_PREFIX = 1024  # model.prefix_length, model.query_tokens
MAX_PROMPT = 1000  # model.prompt, in characters
MAX_LORA_RANK = 1024
DEAD = -1e9


@dataclass
class PrefixLMSettings:
    """``model.decoder: prefix_lm``'s own keys (the mappers read ``prefix_length``, ``query_tokens``,
    ``mapper_layers`` and ``mapper_heads``)."""

    # a keras-hub causal-LM preset folder (save_to_preset's; `captioning lm train` writes one) or preset name
    decoder_preset: str = ""
    # the mapping network from the encoder's tokens to the prefix (ClipCap's frozen-LM pairing: transformer)
    mapper: str = field(default="transformer", metadata=choices("mlp", "transformer", "qformer"))
    prefix_length: int = field(default=10, metadata=between(1, MAX_PREFIX))  # ClipCap's k (mlp, transformer)
    query_tokens: int = field(default=32, metadata=between(1, MAX_PREFIX))  # the Q-Former's queries (BLIP-2's 32)
    # the transformer mapper's layers, and the Q-Former's
    mapper_layers: int = field(default=8, metadata=between(1, MAX_LAYERS))
    mapper_heads: int = field(default=8, metadata=between(1, MAX_HEADS))
    prompt: str = ""  # text the LM reads after the prefix, before the caption (e.g. "a picture of")
    lm_trainable: bool = False  # fine-tune the LM (at train.lm_lr_scale); false: frozen
    lm_lora_rank: int = field(default=0, metadata=between(0, MAX_LORA_RANK))  # >0: train LoRA adapters of this rank

    def check(self, prefix: str = "model.") -> None:
        """The settings against each other (the preset itself: :meth:`check_preset`, when it is read)."""
        if self.lm_trainable and self.lm_lora_rank:
            raise InputError(f"{prefix}lm_trainable and {prefix}lm_lora_rank {self.lm_lora_rank} both train the LM: "
                             f"choose one (full fine-tuning or LoRA adapters)")
        if len(self.prompt) > MAX_PROMPT:
            raise InputError(f"{prefix}prompt has {len(self.prompt)} characters; at most {MAX_PROMPT}")

    def check_preset(self) -> None:
        """An InputError (one line) for no ``decoder_preset`` or a folder that is none: asked when the preset is
        first read (the tokenizer's choice, before a run starts; building the model), not when a config is typed
        (a config may choose the decoder and leave its preset to ``--set``)."""
        preset = self.decoder_preset
        if not preset:
            raise InputError("model.decoder: prefix_lm needs model.decoder_preset: a keras-hub causal-LM preset "
                             "folder (captioning lm train writes one) or preset name, e.g. --set "
                             "model.decoder_preset=runs/lm")
        check_preset_folder(preset, "decoder_preset")


@functools.lru_cache(maxsize=8)
def _captions_tokenizer(preset: str) -> PresetTokenizer:
    """The preset's tokenizer under the project's id rule (loaded once a process: it is only read)."""
    return PresetTokenizer.from_preset(preset)


def _tokenizer(preset: str):
    """The preset's own keras-hub tokenizer."""
    return _captions_tokenizer(preset).lm


def prompt_ids(preset: str, prompt: str) -> list[int]:
    """The LM token ids of ``prompt`` (none for an empty one), as the preset's tokenizer writes them."""
    if not prompt:
        return []
    ids = _tokenizer(preset)(prompt)
    return [int(i) for i in np.asarray(ids).reshape(-1)]


class PrefixLM(CaptionModel):
    """Encoder tokens → mapper → prefix → a pretrained causal LM (module docstring)."""

    settings_class = PrefixLMSettings
    # the mapper's shapes (its prefix constants, layers, heads); the preset: see the module docstring. Not
    # query_tokens: it shapes only the qformer mapper's queries (another count there is the restore's shape check)
    incompatible_keys = ("mapper", "prefix_length", "mapper_layers", "mapper_heads")
    path_keys = ("decoder_preset",)
    features = "grid"
    attends = False
    # the contract tests run it fine-tuned (every decoder variable trained, as they check); the harness writes a
    # tiny GPT-2 preset and sets decoder_preset (tests/harness/models.py)
    tiny_settings = {"prefix_length": 2, "query_tokens": 2, "mapper_layers": 1, "mapper_heads": 2,
                     "lm_trainable": True}
    caption_length_setting = "decoder_preset"

    @classmethod
    def tokenizer_preset(cls, settings) -> str | None:
        settings.check_preset()
        return settings.decoder_preset

    @classmethod
    def max_caption_length(cls, settings) -> int | None:
        """GPT-2: ``max_sequence_length − P + 1`` (module docstring: Bounds); None for rotary positions or a
        preset name."""
        preset = settings.decoder_preset
        config = os.path.join(preset, "config.json") if preset else ""  # (no preset: refused when it is read)
        if not config or not os.path.isfile(config):
            return None
        with open(config) as f:
            inner = json.load(f).get("config", {})
        if "max_sequence_length" not in inner:
            return None
        used = MAPPERS[settings.mapper].output_length(settings) + len(prompt_ids(preset, settings.prompt))
        return max(int(inner["max_sequence_length"]) - used + 1, 0)

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: PrefixLMSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings
        s.check_preset()
        policy = keras.config.dtype_policy().name  # the run's (mixed precision: float32 variables)
        backbone = load_backbone(s.decoder_preset, "decoder_preset", dtype=policy)
        self.lm = adapter(backbone, s.decoder_preset)
        self._vocabulary(vocab_size, _captions_tokenizer(s.decoder_preset), s.decoder_preset, "prefix_lm")
        self.prompt = tf.constant(prompt_ids(s.decoder_preset, s.prompt), tf.int32)
        self.prefix_positions = MAPPERS[s.mapper].output_length(s) + int(self.prompt.shape[0])  # P
        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model.
        self.backbone = backbone
        if s.lm_lora_rank:
            backbone.enable_lora(s.lm_lora_rank)  # every LM weight frozen but the adapters ...
            for variable in backbone.trainable_variables:  # ... and the adapted projections' biases, which it leaves
                if "lora_kernel" not in variable.path:
                    variable.trainable = False
        elif not s.lm_trainable:
            backbone.trainable = False
        if untracked(backbone):  # weights TensorFlow's tracking misses: the checkpoint holds them by index
            self.lm_weights = _Weights(untracked(backbone))
        self.mapper = MAPPERS[s.mapper](s, self.lm.width, seed=seed)
        self.mapper.build((None, None, self.feature_size))
        self.lm_trains = bool(s.lm_trainable or s.lm_lora_rank)

    def _vocabulary(self, vocab_size: int, captions: PresetTokenizer, preset: str, name: str) -> None:
        """The LM's end token and its special tokens (never proposed) for a vocabulary of ``vocab_size`` ids in
        ``captions``' id rule (module docstring: Ids); an InputError naming decoder ``name`` when they do not fit."""
        if not OFFSET < vocab_size <= OFFSET + self.lm.vocabulary_size:
            raise InputError(f"{name}: a vocabulary of {vocab_size} ids does not fit the LM of "
                             f"{preset} ({self.lm.vocabulary_size} tokens + {OFFSET} reserved ids)")
        self.end_token = int(captions.lm.end_token_id)
        if self.end_token >= vocab_size - OFFSET:
            raise InputError(f"{name}: the LM's end token {self.end_token} is outside the vocabulary of "
                             f"{vocab_size} ids")
        special = np.zeros(vocab_size - OFFSET, bool)  # the tokenizer's (start, end, padding, unknown, control...)
        special[[i - OFFSET for i in captions.special_ids() if i - OFFSET < vocab_size - OFFSET]] = True
        self.special = tf.constant(special)  # the LM's special tokens: never proposed

    # ---- the prefix --------------------------------------------------------------------------------
    def initial_state(self, features, training=False, mask=None):
        """The prefix (and prompt) read by the LM but for their last vector, which waits in ``pending`` for
        ``<start>`` (module docstring)."""
        prefix = self.mapper(features, mask=mask, training=training)
        rows = tf.shape(prefix)[0]
        dtype = self.backbone.compute_dtype
        sequence = tf.cast(prefix, dtype)
        if self.prompt.shape[0]:
            prompt = tf.cast(self.lm.embed(self.prompt[None]), dtype)
            sequence = tf.concat([sequence, tf.tile(prompt, [rows, 1, 1])], axis=1)
        return self.state_before_start(sequence, training)

    def state_before_start(self, sequence, training=False):
        """The state of input vectors ``[B, P, width]`` (a prefix and prompt; P static): all but the last read by
        the LM into the cache, the last waiting in ``pending`` for ``<start>``."""
        rows, before = tf.shape(sequence)[0], int(sequence.shape[1]) - 1
        cache = self.lm.empty_cache(rows, before, sequence.dtype)
        if before:
            _, cache = self.lm.run(sequence[:, :before], cache, tf.constant(0, tf.int32), self._lm_training(training))
        return {"cache": cache, "pending": sequence[:, before], "t": tf.fill([rows], tf.constant(before, tf.int32))}

    def _lm_training(self, training):
        return bool(training) and self.lm_trains  # a frozen LM runs in inference mode (no dropout)

    def reserve(self, state, steps):
        """Room for ``steps`` more pieces' keys and values after the ``t`` cached (zeros, masked)."""
        cache = state["cache"]
        room = tf.maximum(_index(state["t"]) + steps - tf.shape(cache)[3], 0)
        return {**state, "cache": _grown(cache, room)}

    # ---- the pieces --------------------------------------------------------------------------------
    def _inputs(self, input_ids, pending):
        """Input vectors ``[B, T, width]``: ``<start>`` reads ``pending``, a piece its LM embedding."""
        ids = tf.cast(input_ids, tf.int32)
        lm_ids = tf.where(ids >= OFFSET, ids - OFFSET, self.end_token)
        x = self.lm.embed(lm_ids)
        pending = tf.cast(pending, x.dtype)[:, None, :]
        return tf.where(tf.equal(ids, START_ID)[..., None], pending, x)

    def _logits(self, hidden):
        """LM logits → project logits ``[..., V]`` in float32 (module docstring: Ids)."""
        lm = tf.cast(self.lm.logits(hidden), tf.float32)
        end = lm[..., self.end_token:self.end_token + 1]
        words = tf.where(self.special, DEAD, lm[..., :self.vocab_size - OFFSET])
        dead = tf.fill(tf.shape(end), DEAD)
        columns = [dead] * OFFSET
        columns[END_ID] = end
        return tf.concat([*columns, words], axis=-1)

    def _run(self, input_ids, state, training, grow=True):
        """``grow``: pad the cache to hold the pieces (a teacher-forced pass); a step reads the room :meth:`reserve`
        made, so its cache keeps its shape from step to step (a loop variable; XLA needs the pad's size constant)."""
        index = _index(state["t"])
        steps = tf.shape(input_ids)[1]
        cache = state["cache"]
        if grow:
            room = tf.maximum(index + steps - tf.shape(cache)[3], 0)
            cache = _grown(cache, room)
        x = self._inputs(input_ids, state["pending"])
        hidden, cache = self.lm.run(x, cache, index, self._lm_training(training))
        return self._logits(hidden), {**state, "cache": cache, "t": state["t"] + steps}

    def step(self, token_ids, state):
        """One piece at ``t`` (:meth:`reserve` first: a step with no slot left is an error)."""
        tf.debugging.assert_less(_index(state["t"]), tf.shape(state["cache"])[3], message="PrefixLM.step: no room "
                                 "left in the cache for the piece (reserve(state, steps) first, for every step taken)")
        logits, state = self._run(token_ids[:, None], state, training=False, grow=False)
        return logits[:, 0], state

    def teacher_forced(self, state, input_ids, training=False):
        """All of ``input_ids [B, T]`` at once at positions ``t … t + T − 1`` (the cache grown to hold them)."""
        return self._run(input_ids, state, training)

    def decoder_variables(self) -> list:
        encoder = {id(v) for v in self.encoder.weights}
        return [v for v in self.weights if id(v) not in encoder]

    def lora_backbone(self):
        return self.backbone if adapted_layers(self.backbone) else None

    def lm_variables(self) -> list:
        """The LM's trainable variables (fine-tuned, or its LoRA adapters): ``train.lm_lr_scale`` scales their rate."""
        return list(self.backbone.trainable_variables) if self.lm_trains else []


def _grown(cache, room):
    """The cache ``[B, layers, 2, T, heads, size]`` with ``room`` more positions of zeros, padded as ``[B · layers · 2,
    T, heads, size]`` (LiteRT's built-in PAD takes at most 5 dimensions: ``export --format litert`` converts it)."""
    shape = tf.shape(cache)
    flat = tf.reshape(cache, tf.concat([[-1], shape[3:]], 0))
    flat = tf.pad(flat, [[0, 0], [0, room], [0, 0], [0, 0]])
    grown = tf.reshape(flat, tf.concat([shape[:3], [shape[3] + room], shape[4:]], 0))
    grown.set_shape([*cache.shape[:3], None, *cache.shape[4:]])
    return grown


def _index(t):
    """The cache index of a state's rows (all at the same place; an empty batch: 0)."""
    return tf.reduce_max(tf.concat([tf.cast(t, tf.int32), [0]], axis=0))
