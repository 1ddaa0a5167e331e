"""The text a language model learns from (``captioning lm train``), and its tokenizer trained on that text,
offline and without TensorFlow.

**Text.** A plain text file holds one sentence per line (``captioning synth --text-only`` writes one;
blank lines are skipped); a prepared dataset's sentences are its records' ``caption/text`` of one split,
read by :meth:`captioning.data.prepared.PreparedDataset.caption_texts` (the command line hands them in). Every
sentence is normalised as the preset tokenizer normalises a caption before it tokenizes it
(:func:`normalize`: lowercased, every run of characters that are not letters, digits or apostrophes one
space, stripped), so the language model learns the text it is later asked to continue: ``"A red circle."``
is ``"a red circle"``. A sentence that normalises to nothing is dropped.

**Tokenizers**, each trained on the sentences the model learns from, deterministic for the same text:

- GPT-2 (:func:`train_byte_level_bpe`): a byte-level BPE (the ``tokenizers`` package's ``models.BPE`` with the
  ``ByteLevel`` pre-tokenizer and decoder, GPT-2's), the special ``<|endoftext|>`` (GPT-2's start and end token)
  last, as GPT-2's is (id 50256): keras-hub's ``GPT2Tokenizer`` pads with id 0, which must not be the end token
  (``generate`` would stop at once); returned as the vocabulary dict and the merges list
  ``keras_hub.models.GPT2Tokenizer`` takes;
- Gemma (:func:`train_sentencepiece`): a SentencePiece BPE model trained in this process, Gemma's special pieces at
  Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3) and byte fallback, so every text encodes; the
  serialized model ``keras_hub.models.GemmaTokenizer(proto=...)`` takes.

``vocabulary_size`` is an upper bound: a small text has fewer pieces to learn (the tokenizers stop when every
pair is merged).
"""

from __future__ import annotations

import io
import os
import re

from captioning.errors import InputError

GPT2_END = "<|endoftext|>"  # GPT-2's one special token: start, end and padding
GEMMA_SPECIALS = {"pad": (0, "<pad>"), "eos": (1, "<eos>"), "bos": (2, "<bos>"), "unk": (3, "<unk>")}
MAX_TEXT_BYTES = 4 << 30  # a text file read whole into memory: 4 GiB, ~60 million captions
MIN_SENTENCES = 2  # one to learn from and one held out
_NOT_WORD = re.compile(r"(?:[^\w']|_)+")


def normalize(text: str) -> str:
    """The preset tokenizer's normalisation of a caption, in Python.

    >>> normalize("  A red-ish CIRCLE, isn't it?  ")
    "a red ish circle isn't it"
    """
    return _NOT_WORD.sub(" ", text.lower()).strip()


def read_text_file(path: str, what: str = "`text`", params: tuple[str, ...] = ("text",)) -> list[str]:
    """The normalised, non-empty sentences of the UTF-8 text file ``path``, one a line. One line
    (:class:`InputError` naming ``what``) when it is missing, not a regular file, larger than
    :data:`MAX_TEXT_BYTES`, not UTF-8 or without :data:`MIN_SENTENCES` sentences."""
    if not os.path.exists(path):
        raise InputError(f"{what} {path} does not exist", params=params)
    if not os.path.isfile(path):
        raise InputError(f"{what} {path} is not a text file or a prepared dataset folder", params=params)
    size = os.path.getsize(path)
    if size > MAX_TEXT_BYTES:
        raise InputError(f"{what} {path} has {size:,} bytes, more than the {MAX_TEXT_BYTES:,} read at most",
                         params=params)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {e.start:,})", params=params) from None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read it ({e.strerror or e})", params=params) from None
    return sentences_of(lines, f"{what} {path}", params)


def sentences_of(texts, what: str, params: tuple[str, ...] = ()) -> list[str]:
    """``texts`` normalised, the empty ones dropped; one line naming ``what`` when fewer than
    :data:`MIN_SENTENCES` are left."""
    sentences = [s for s in (normalize(t) for t in texts) if s]
    if len(sentences) < MIN_SENTENCES:
        raise InputError(f"{what} holds {len(sentences)} sentence(s) with a word in them; a language model needs "
                         f"at least {MIN_SENTENCES} (one to learn from, one held out)", params=params)
    return sentences


def train_byte_level_bpe(sentences: list[str], vocabulary_size: int) -> tuple[dict[str, int], list[str]]:
    """GPT-2's tokenizer learnt from ``sentences``: (piece → id, merges ``"a b"`` in order): the 256 byte pieces,
    the merged ones, ``<|endoftext|>`` last; at most ``vocabulary_size`` pieces in all."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # a space in front of each sentence, as the preset tokenizer of a caption decoder puts one before a caption
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocabulary_size - 1, min_frequency=2, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sentences, trainer=trainer, length=len(sentences))
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocabulary = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    assert list(vocabulary.values()) == list(range(len(vocabulary))) and GPT2_END not in vocabulary
    vocabulary[GPT2_END] = len(vocabulary)  # last, as GPT-2's 50256: id 0 (keras-hub's padding) is a byte piece
    return vocabulary, merges


CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")  # last, as in OpenAI's vocabulary: the end has the largest id
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def train_clip_bpe(sentences: list[str], vocabulary_size: int) -> tuple[dict[str, int], list[str]]:
    """CLIP's tokenizer learnt from ``sentences``: (piece → id, merges) as keras-hub's ``CLIPTokenizer`` reads them:
    lower-cased words split as CLIP splits them, byte-level, a word's last piece ending in ``</w>``; every byte
    alone and ending a word (so that no text maps to the unknown token, which CLIP's is the end-of-text token),
    the merges learnt, ``<|startoftext|>`` and ``<|endoftext|>`` last; at most ``vocabulary_size`` pieces besides
    the bytes'."""
    import json

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                 normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocabulary_size, min_frequency=2, special_tokens=[],
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(sentences, trainer=trainer, length=len(sentences))
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    pieces = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    known = set(pieces)
    for byte in sorted(pre_tokenizers.ByteLevel.alphabet()):
        for piece in (byte, byte + "</w>"):
            if piece not in known:
                pieces.append(piece)
                known.add(piece)
    return {piece: i for i, piece in enumerate(pieces + list(CLIP_SPECIALS))}, merges


def train_sentencepiece(sentences: list[str], vocabulary_size: int) -> bytes:
    """Gemma's tokenizer learnt from ``sentences``: a serialized SentencePiece BPE model, Gemma's special pieces
    at their ids, byte fallback, at most ``vocabulary_size`` pieces (its 256 byte pieces and the four special ones
    included)."""
    import sentencepiece

    out = io.BytesIO()
    names = {f"{name}_id": i for name, (i, _) in GEMMA_SPECIALS.items()}
    pieces = {f"{name}_piece": piece for name, (_, piece) in GEMMA_SPECIALS.items()}
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=out, vocab_size=max(vocabulary_size, 300),
        hard_vocab_limit=False, model_type="BPE", byte_fallback=True, character_coverage=1.0, minloglevel=2,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        max_sentence_length=1 << 16, **names, **pieces)
    return out.getvalue()
