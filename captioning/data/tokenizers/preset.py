"""``data.tokenizer: preset``: a keras-hub preset's own tokenizer (GPT-2's byte-level BPE, Gemma's SentencePiece,
Llama's, Qwen's, …), run inside the input pipeline on the records' ``caption/text``.

The id rule is the package's (:mod:`captioning.data.tokenizers`): the language model's id ``i`` is project id
``i + 4``, END stands for its end token, its special tokens are never proposed.

**What a caption becomes.** :func:`~captioning.data.tokenizers.base.normalized` (lowercase, runs of characters
other than letters, digits and apostrophes one space, stripped), then, for a tokenizer whose first word would
otherwise lack the word-start mark (GPT-2's BPE splits ``"a red"`` into ``a Ġred``), one space in front: every word
of a caption is then the same pieces wherever it stands (``Ġa Ġred``), as after a prompt (BLIP's ``"a picture of"``).
A SentencePiece model that adds its own dummy prefix (``▁a ▁red``) gets no second one. The tokenizer's own
``tokenize`` splits that text (its TensorFlow path: no Python in the pipeline); the ids are offset and framed,
``[START, i₁ + 4, …, END]``.

**Back to text.** Each project id's bytes are a table made once from the language model's vocabulary: a
byte-level BPE piece's characters through GPT-2's byte ↔ unicode table (``Ġ`` is a space), a SentencePiece
piece with ``▁`` as a space and its byte pieces (``<0x41>``) as the byte, special tokens and the reserved ids
nothing. :meth:`PresetTokenizer.detokenize` gathers the bytes in TensorFlow (a ``tf.gather`` and a join:
what an exported graph can hold), :meth:`PresetTokenizer.decode` joins them in Python; both read the bytes as
UTF-8 (an invalid sequence, a multi-byte character cut by END, becomes U+FFFD) and split the words on
whitespace, so ``text == " ".join(decode)`` and it is keras-hub's own ``detokenize`` with its spaces
normalised (tests/test_tokenizers.py). :meth:`PresetTokenizer.pieces` are those bytes as text, or as bytes for a
piece that is part of a character.

**In a model folder** the tokenizer is kept as ``tokenizer/`` (its ``save_to_preset``: ``tokenizer.json`` and its
assets), so ``caption``, ``evaluate`` and ``serve`` never reach the preset it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from captioning.data.tokenizers.base import Tokenizer, before_end, normalized, with_start_and_end
from captioning.errors import InputError, excerpt
from captioning.fileio import atomic_folder
from captioning.vocab import END_ID, RESERVED

OFFSET = len(RESERVED)  # a language model's id i is project id i + OFFSET
FOLDER = "tokenizer"  # its folder in a model folder
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
FAMILIES = ("BytePairTokenizer", "SentencePieceTokenizer")  # what keras-hub's tokenizers are made of, here
# each byte-pair tokenization's traced function in this process, by the tokenizer's identity and settings
# (PresetTokenizer.caption_ids): the first tokenizer object of them traces it, the later ones call it
_TRACED: dict = {}


def _keep_model(lm) -> None:
    """Make keras-hub's SentencePiece tokenizer ``lm`` read its model from a resource the process keeps.
    TensorFlow Text loads the model into a resource that the eager kernel which made it owns (keras-hub makes it
    when it loads the tokenizer), and TensorFlow drops its eager kernels whenever the global seed is set
    (``tf.random.set_seed``, ``keras.utils.set_random_seed``: a Trainer made after the run's tokenizer, a second
    run in one process) or Keras' session is cleared: every later tokenization in TensorFlow then failed (the
    resource does not exist). Here the model is loaded again under a name, the hash of the model, which keeps it
    until the process ends; tokenizers of one model share it (as they shared the kernel). A keras-hub whose
    tokenizer is made otherwise is left as it is."""
    import tensorflow as tf
    from tensorflow_text.python.ops import sentencepiece_tokenizer as text_ops

    model = getattr(getattr(lm, "_sentence_piece", None), "_model_resource", None)
    if model is None or not isinstance(lm.proto, bytes):
        return
    with tf.init_scope():  # an eager resource, even for a tokenizer made inside a trace
        model._resource_handle = text_ops.gen_sentencepiece_tokenizer.sentencepiece_op(
            model=lm.proto, shared_name=f"captioning-sentencepiece-{hashlib.sha256(lm.proto).hexdigest()[:16]}")


def _text(piece: bytes) -> str | bytes:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return piece


class PresetTokenizer(Tokenizer):
    """A keras-hub tokenizer under the project's id rule (module docstring). ``lm``: a
    ``keras_hub.tokenizers.Tokenizer`` of a family in :data:`FAMILIES`."""

    kind = "preset"

    def __init__(self, lm, source: str = ""):
        import keras_hub

        families = (keras_hub.tokenizers.BytePairTokenizer, keras_hub.tokenizers.SentencePieceTokenizer)
        if not isinstance(lm, families):
            raise InputError(f"{source or 'the preset'}'s tokenizer is a {type(lm).__name__}, which a caption decoder "
                             f"cannot read: a causal language model's tokenizer is built on {' or '.join(FAMILIES)}")
        self.lm, self.source = lm, source
        if isinstance(lm, keras_hub.tokenizers.SentencePieceTokenizer):
            _keep_model(lm)
        self.lm_size = int(lm.vocabulary_size())
        self.lm_start_id, self.lm_end_id = lm.start_token_id, lm.end_token_id  # its own ids (None: it has none)
        self.lm_pad_id = lm.pad_token_id
        self._bytes, self._special = self._piece_bytes()
        first = lm.tokenize(["a"])  # keras-hub's Python path outside a graph: no trace for one word
        first = [int(i) for i in (first.to_list() if hasattr(first, "to_list") else list(first))[0]]
        self._space = bool(first) and not self._bytes[first[0] + OFFSET].startswith(b" ")
        self._graph = self._eager = None

    # ---- making one -----------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, preset: str, what: str = "model.decoder_preset") -> "PresetTokenizer":
        """The tokenizer of the keras-hub preset ``preset`` (a folder, or a name keras-hub resolves)."""
        import keras_hub

        try:
            lm = keras_hub.tokenizers.Tokenizer.from_preset(preset)
        except (ValueError, OSError, KeyError) as e:
            raise InputError(f"{what} {preset}: no keras-hub tokenizer could be loaded from it "
                             f"({excerpt(str(e).splitlines()[0] if str(e) else type(e).__name__)})") from None
        return cls(lm, preset)

    @classmethod
    def load_from(cls, folder: str) -> "PresetTokenizer | None":
        """The tokenizer a model folder keeps in ``tokenizer/`` (:meth:`save_to`), or None when there is none."""
        path = os.path.join(folder, FOLDER)
        if not os.path.isdir(path):
            return None
        import keras

        try:
            with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
                lm = keras.saving.deserialize_keras_object(json.load(f))
            lm.load_preset_assets(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{path} is damaged or not a saved tokenizer ({excerpt(str(e) or type(e).__name__)}); "
                             "put it back from a copy of the model folder") from None
        return cls(lm, path)

    def save_to(self, folder: str) -> None:
        with atomic_folder(os.path.join(folder, FOLDER)) as tmp:
            self.lm.save_to_preset(tmp)

    # ---- the vocabulary ---------------------------------------------------------------------------------
    def _piece_bytes(self) -> tuple[list[bytes], set[int]]:
        """Each project id's bytes (module docstring) and the project ids of the language model's special
        tokens."""
        import keras_hub

        lm, tokens = self.lm, [self.lm.id_to_token(i) for i in range(self.lm_size)]
        special = {int(i) for i in lm.special_token_ids if i is not None and 0 <= i < self.lm_size}
        if isinstance(lm, keras_hub.tokenizers.BytePairTokenizer):
            from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode

            byte_of = {char: byte for byte, char in zip(*bytes_to_unicode())}
            special |= {lm.token_to_id(t) for t in (lm.unsplittable_tokens or ()) if t in lm.vocabulary}
            pieces = [b"" if i in special else b"".join(byte_of.get(ch, ch.encode()) for ch in token)
                      for i, token in enumerate(tokens)]
        else:
            import sentencepiece

            processor = sentencepiece.SentencePieceProcessor(model_proto=lm.proto)
            special |= {i for i in range(self.lm_size)
                        if processor.is_control(i) or processor.is_unknown(i) or processor.is_unused(i)}
            pieces = []
            for i, token in enumerate(tokens):
                byte = _BYTE_PIECE.match(token) if processor.is_byte(i) else None
                pieces.append(b"" if i in special else bytes([int(byte.group(1), 16)]) if byte else
                              token.replace("\u2581", " ").encode())
        return [b""] * OFFSET + pieces, {i + OFFSET for i in special}

    def __len__(self) -> int:
        return OFFSET + self.lm_size

    @property
    def identity(self) -> str:
        """A hash of the class, the pieces' bytes, the special tokens and how text is split into pieces (the BPE
        merges or the SentencePiece model)."""
        digest = hashlib.sha256(type(self.lm).__name__.encode())
        for piece in self._bytes:
            digest.update(len(piece).to_bytes(4, "little") + piece)
        digest.update(repr(sorted(self._special)).encode())
        rules = getattr(self.lm, "merges", None)
        digest.update("\n".join(rules).encode() if rules is not None else bytes(getattr(self.lm, "proto", b"") or b""))
        return f"preset-{type(self.lm).__name__}-{digest.hexdigest()[:16]}"

    def pieces(self) -> list[str | bytes]:
        """Each project id's text; ``bytes`` for a piece that is part of a character (a byte-level BPE's or a
        SentencePiece byte piece's bytes of a multi-byte UTF-8 character), which only its neighbours complete."""
        return [_text(piece) for piece in self._bytes]

    def starts_word(self) -> np.ndarray:
        return np.array([piece.startswith(b" ") for piece in self._bytes], bool)

    def special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._special))

    # ---- TensorFlow ------------------------------------------------------------------------------------
    def _tables(self):
        """The bytes of each project id and whether it is written (not reserved, not special), as constants."""
        if self._graph is None:
            import tensorflow as tf

            written = np.ones(len(self), bool)
            written[:OFFSET] = False
            written[list(self._special)] = False
            with tf.init_scope():  # eager constants, which any later graph captures (not the first trace's own)
                self._graph = (tf.constant(self._bytes, tf.string), tf.constant(written))
        return self._graph

    def caption_ids(self, texts):
        """(The base class's contract.) One ``tf.function`` of a fixed signature per tokenization, traced once in
        a process and called from every graph after: keras-hub tokenizes in TensorFlow only inside a graph (else in
        Python), and tracing its tokenizer costs 1.5-2.7 CPU s, which every input pipeline built (a training's,
        each evaluation's) paid again when the ops were written into its own graph. Tokenizer objects that
        tokenize alike (the same :attr:`identity` and keras-hub settings: an ensemble's members, a model folder
        loaded again) share it when they are byte-pair tokenizers (GPT-2's, Llama 3's, Qwen's: the costly trace,
        over lookup tables made eagerly). A SentencePiece tokenizer (one op, cheap to trace) keeps its own; its
        model is a resource of the process (:func:`_keep_model`)."""
        import keras_hub
        import tensorflow as tf

        if getattr(self, "_traced", None) is None:
            traced = tf.function(self._caption_ids, input_signature=[tf.TensorSpec([None], tf.string)],
                                 autograph=False)
            if isinstance(self.lm, keras_hub.tokenizers.BytePairTokenizer):  # eager tables: any object reads them
                settings = {k: v for k, v in self.lm.get_config().items() if k != "name"}  # (a name Keras numbers)
                traced = _TRACED.setdefault((self.identity, json.dumps(settings, sort_keys=True, default=repr)), traced)
            self._traced = traced
        return self._traced(tf.convert_to_tensor(texts, tf.string))

    def _caption_ids(self, texts):
        import tensorflow as tf

        texts = normalized(texts)
        if self._space:  # (an empty caption stays empty: no lone space piece)
            texts = tf.where(tf.equal(texts, ""), texts, tf.strings.join([" ", texts]))
        ids = self.lm.tokenize(texts)
        if not isinstance(ids, tf.RaggedTensor):  # a tokenizer with a sequence_length pads: not here
            raise ValueError(f"{self.source}'s tokenizer gives padded sequences: it must have no sequence_length")
        return with_start_and_end(tf.cast(ids, tf.int64) + OFFSET)

    def image_captions(self, ids, texts):
        import tensorflow as tf

        splits = texts.row_splits  # (the records' captions: int32 row splits, as their caption/ids have)
        return tf.RaggedTensor.from_row_splits(self.caption_ids(texts.flat_values).with_row_splits_dtype(splits.dtype),
                                               splits)

    def detokenize(self, ids):
        import tensorflow as tf

        pieces, written = self._tables()
        ids = tf.cast(ids, tf.int64)
        keep = before_end(ids) & tf.gather(written, ids)
        joined = tf.strings.reduce_join(tf.where(keep, tf.gather(pieces, ids), ""), axis=-1)
        joined = tf.strings.unicode_transcode(joined, "UTF-8", "UTF-8", errors="replace")
        return tf.strings.strip(tf.strings.regex_replace(joined, r"\s+", " "))

    # ---- Python ---------------------------------------------------------------------------------------
    def decode(self, ids) -> list[str]:
        out = []
        for i in ids:
            i = int(i)
            if i == END_ID:
                break
            if i not in self._special:
                out.append(self._bytes[i])
        return b"".join(out).decode("utf-8", "replace").split()
