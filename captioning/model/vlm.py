"""``model.decoder: vlm``: a pretrained keras-hub vision-language model fine-tuned to caption (PaliGemma; the
families of :mod:`captioning.model.vision_language`), trained and decoded by this project's own pipeline, loop and
decoding toolbox instead of keras-hub's ``fit`` and ``generate``.

``model.vlm_preset`` names the preset (a folder ``save_to_preset`` wrote, or a keras-hub preset name); the encoder
is its vision tower, ``model.encoder: vlm`` (:mod:`captioning.model.encoders.vision_language`, which loads the
preset once and hands this decoder its language model), and the tokenizer is its own (``data.tokenizer: auto``).
The model reads, as the family's preprocessor packs it::

    [ image tokens (N) | <bos> | the prompt's pieces | the caption's pieces | <eos> ]     (PaliGemma)
    [ <bos> | the prompt's pieces, the image tokens among them | the caption's pieces | <eos> ]    (Gemma 3)
      the prefix: P positions, read with the family's prefix attention               causal

``model.prompt`` defaults to the family's captioning prompt (PaliGemma's ``caption en\\n``; Gemma 3's a plain
instruction after the image). The loss is on the
caption's pieces and ``<eos>`` only (the project's loss masks everything but the caption: the prefix is not in the
targets at all), as keras-hub's preprocessor weighs PaliGemma's response.

**Decoding state** (the :class:`~captioning.model.prefix_lm.PrefixLM` contract, whose stepping this decoder
inherits): :meth:`VisionLanguageModel.initial_state` reads the whole prefix with the family's attention into a cache
of ``P`` slots and keeps its last vector in ``pending`` with ``t = P − 1``; ``<start>`` reads ``pending`` again at
position ``P − 1`` (from the whole prefix's cache it gives exactly what the prefix pass gave there), whose output
gives the first word; word ``n`` is read at ``P − 1 + n``. Ids, logits, caches, growing them and LoRA are the
prefix decoder's (:mod:`captioning.model.prefix_lm`).

**Training** (``model.vlm_trainable``): ``lora`` (the default, as keras-hub's PaliGemma guide fine-tunes) trains
rank-``model.lm_lora_rank`` adapters of the language model's query and value projections, every other weight
frozen; ``all`` fine-tunes the whole language model at ``train.lm_lr_scale`` times the learning rate; ``none``
trains nothing of it (the preset as it is, for evaluating it). The vision tower is the encoder's:
frozen unless ``model.encoder_trainable`` (keras-hub's LoRA also adapts the ViT's projections; frozen with it).

**Precision** (``model.vlm_precision``): ``auto`` trains in mixed precision (float32 variables, bfloat16 compute on
CPUs and TPUs, float16 with loss scaling on GPUs: ``train.mixed_precision``'s) when the preset was saved in bfloat16
or float16, as the real PaliGemma and Gemma 3 presets are, and says so in the log; ``mixed`` and ``float32`` decide
it whatever the preset says. ``train.mixed_precision: true`` is mixed precision for any model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import tensorflow as tf

from captioning.config import ModelConfig
from captioning.config.settings import between, choices
from captioning.errors import InputError
from captioning.model.base import CaptionModel, _Weights, untracked
from captioning.model.encoders.base import ImageEncoder
from captioning.model.encoders.vision_language import check_vlm_preset
from captioning.model.prefix_lm import MAX_LORA_RANK, MAX_PROMPT, PrefixLM, _captions_tokenizer


@dataclass
class VisionLanguageSettings:
    """``model.decoder: vlm``'s own keys (``model.vlm_preset`` is the encoder's too)."""

    vlm_preset: str = ""  # a keras-hub image-text preset folder (save_to_preset's) or preset name
    prompt: str = ""  # what the model reads before the caption; empty: the family's captioning prompt
    vlm_trainable: str = field(default="lora", metadata=choices("none", "lora", "all"))
    lm_lora_rank: int = field(default=4, metadata=between(1, MAX_LORA_RANK))  # vlm_trainable: lora's rank
    # auto: mixed precision when the preset was saved in bfloat16 or float16 (as real PaliGemma and Gemma 3 presets
    # are; float32 variables, computed in the low precision), float32 otherwise; mixed or float32: as said
    vlm_precision: str = field(default="auto", metadata=choices("auto", "mixed", "float32"))

    def check(self, prefix: str = "model.") -> None:
        if len(self.prompt) > MAX_PROMPT:
            raise InputError(f"{prefix}prompt has {len(self.prompt)} characters; at most {MAX_PROMPT}")


def preset_dtype(preset: str) -> str | None:
    """The dtype policy name a keras-hub preset's backbone was saved with (its ``config.json``), or None when the
    preset is no folder holding one (a preset name: keras-hub's to read) or does not say."""
    path = os.path.join(preset, "config.json") if preset else ""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            dtype = json.load(f).get("config", {}).get("dtype")
    except (OSError, ValueError):
        return None
    if isinstance(dtype, dict):  # a serialized DTypePolicy
        dtype = dtype.get("config", {}).get("name")
    return dtype if isinstance(dtype, str) else None


class VisionLanguageModel(PrefixLM):
    """A keras-hub vision-language model as a captioner (module docstring)."""

    settings_class = VisionLanguageSettings
    incompatible_keys = ()  # another preset of other shapes: the restore's shape check
    path_keys = ("vlm_preset",)
    features = "grid"
    attends = False
    own_encoder = "vlm"  # it reads images with its preset's vision tower, which model.encoder: vlm is
    # the contract tests fine-tune it all (every decoder variable trained); the harness writes a tiny PaliGemma
    tiny_settings = {"vlm_trainable": "all"}
    caption_length_setting = None

    @classmethod
    def tokenizer_preset(cls, settings) -> str | None:
        check_vlm_preset(settings.vlm_preset)
        return settings.vlm_preset

    @classmethod
    def mixed_precision(cls, settings) -> bool:
        if settings.vlm_precision != "auto":
            return settings.vlm_precision == "mixed"
        return (preset_dtype(settings.vlm_preset) or "float32").replace("mixed_", "") in ("bfloat16", "float16")

    @classmethod
    def max_caption_length(cls, settings) -> int | None:
        return None  # Gemma's rotary positions: no bound; BLIP-2's OPT reads its last position past its last (as GPT-2)

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: VisionLanguageSettings | None = None, **kwargs):
        CaptionModel.__init__(self, **kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings
        family = getattr(encoder, "family", None)
        if family is None:
            raise InputError(f"model.decoder: vlm reads images with its preset's own vision tower: set "
                             f"model.encoder: vlm (not {cfg.encoder})")
        if not self.source.reads_encoder_tokens:
            raise InputError("model.decoder: vlm reads images through its preset's vision tower, not stored regions: "
                             "set data.features: images")
        self.family, self.lm = family, family.text
        captions = _captions_tokenizer(s.vlm_preset)
        self._vocabulary(vocab_size, captions, s.vlm_preset, "vlm")
        self.prefix_ids = family.prefix_ids(captions.lm, s.prompt or family.prompt)  # (image placeholders too)
        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model.
        self.backbone = backbone = family.backbone
        if s.vlm_trainable == "lora":
            backbone.enable_lora(s.lm_lora_rank)
        # what trains, variable by variable (Keras' trainable flag does not reach the layers keras-hub keeps in
        # plain lists, as PaliGemma's ViT blocks): the LM as vlm_trainable says (LoRA: only the adapters, not the
        # adapted projections' biases, which Keras' LoRA leaves trainable), the vision tower as the encoder says
        for variable in backbone.weights:
            variable.trainable = s.vlm_trainable == "all" or (s.vlm_trainable == "lora" and
                                                               "lora_kernel" in variable.path)
        for variable in encoder.model.weights:
            variable.trainable = encoder.trainable
        if untracked(backbone):  # weights TensorFlow's tracking misses: the checkpoint holds them by index
            self.lm_weights = _Weights(untracked(backbone))
        self.lm_trains = s.vlm_trainable != "none"

    def initial_state(self, features, training=False, mask=None):
        """The prefix (image tokens, start token, prompt) read with the family's attention into a cache of ``P``
        slots; its last vector waits in ``pending`` for ``<start>``, at ``t = P − 1`` (module docstring)."""
        rows = tf.shape(features)[0]
        dtype = self.backbone.compute_dtype
        text = tf.cast(self.lm.embed(tf.constant([self.prefix_ids], tf.int32)), dtype)
        sequence = self.family.join(tf.cast(features, dtype), tf.tile(text, [rows, 1, 1]), self.prefix_ids)
        positions = int(sequence.shape[1])
        cache = self.lm.empty_cache(rows, positions, dtype)
        _, cache = self.family.prefix(sequence, cache, self.prefix_ids, self._lm_training(training))
        return {"cache": cache, "pending": sequence[:, -1],
                "t": tf.fill([rows], tf.constant(positions - 1, tf.int32))}

    def lm_variables(self) -> list:
        encoder = {id(v) for v in self.encoder.weights}
        return [v for v in self.backbone.trainable_variables if id(v) not in encoder] if self.lm_trains else []
