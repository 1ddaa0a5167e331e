"""``captioning lm train``: a keras-hub causal language model trained on text, written as a preset folder that
``model.decoder_preset`` (and ``keras_hub.models.Backbone.from_preset`` / ``keras_hub.tokenizers.Tokenizer.
from_preset``) reads offline. The text and its tokenizer come in ready (``data_prep/lm_text.py``, wired by
``captioning/cli/lm.py``): sentences normalised as the preset tokenizer normalises captions, and the tokenizer's
parts (GPT-2: ``vocabulary`` and ``merges``; Gemma: ``proto``).

**Sizes** (:data:`SIZES`; ``--size``). ``tiny`` is for CPU work (a 3,000-step run on the hard scenes' captions in
minutes, docs/language_models.md), ``small`` a few times larger, and the real models' dimensions for a machine with a
GPU (a user with internet passes a real preset name to ``model.decoder_preset`` instead):

=============  ======  =====  ======  ========  ============  =============  =======  ==============
architecture   size    layers width   heads     key/value h.  feed-forward   vocab    positions
=============  ======  =====  ======  ========  ============  =============  =======  ==============
gpt2           tiny    2      128     4         (4)           512            1,000    128
gpt2           small   6      256     8         (8)           1,024          8,000    512
gpt2           base    12     768     12        (12)          3,072          50,257   1,024 (GPT-2)
gemma          tiny    2      128     4         1             1,024          1,000    (rotary)
gemma          small   6      256     8         1             2,048          8,000    (rotary)
gemma          2b      18     2,048   8         1             32,768         256,000  (Gemma 2B)
=============  ======  =====  ======  ========  ============  =============  =======  ==============

Gemma's head width is 32 (256 for 2b), its feed-forward size keras-hub's ``intermediate_dim`` (two gates of half
of it). The vocabulary is an upper bound: the tokenizer learns at most that many pieces from the text.

**Training** (:func:`train_language_model`). The sentences are tokenized by the keras-hub tokenizer that is saved
(the same ids a decoder later sees) and packed into one stream as the models were pretrained: GPT-2's
``<|endoftext|>`` before every sentence (and a space, :func:`needs_space`) and after the last, Gemma's ``<bos>``
sentence ``<eos>``, the sentences in a seeded random order (neighbours in a text, such as one image's five
captions, would teach copying from the context, which a caption after a visual prefix never has); windows of
``sequence_length + 1`` tokens (each position up to ``sequence_length`` is trained, so a caption after a visual
prefix sits at trained positions) are drawn in a seeded order, every window once an epoch. A held-out slice of the
sentences (one in 50, at least 1, at most 10,000, chosen by the seed) is never trained on. The step is keras-hub's
``GPT2CausalLM``/``GemmaCausalLM`` forward (tied input and output embeddings) and cross-entropy in one
``tf.function`` (measured on CPU: as fast as ``fit`` and XLA within 15%), AdamW (weight decay 0.01, gradient norm
clipped at 1), the learning rate warmed up linearly over the first tenth of the steps (at most 1,000) and then
cosine-decayed to a tenth. Logged: the loss every tenth of the run, then the final training loss (the mean of the
run's last tenth, at most 100 steps), the unigram entropy of the training tokens (the loss of a model that knows
only each piece's frequency), the held-out loss and perplexity, and a greedy continuation of the held-out slice's
first two words.

**Output**: the task's ``save_to_preset`` (backbone, tokenizer, the causal LM's preprocessor and task config: also
``keras_hub.models.CausalLM.from_preset(dir).generate(...)`` works) and ``training.json`` (:data:`RECORD`: the
settings, the text's identity, the figures), written in a temporary folder renamed to the output when complete.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import numpy as np

from captioning.errors import InputError
from captioning.fileio import atomic_folder, atomic_write_json, read_record

log = logging.getLogger("captioning")

RECORD = "training.json"  # the settings and figures of the run, beside the preset's own files
HELD_OUT_SHARE, MAX_HELD_OUT = 50, 10_000  # one sentence in 50, at most 10,000
_GPT2 = ("layers", "width", "heads", "feed_forward", "vocabulary", "positions")
_GEMMA = ("layers", "width", "heads", "kv_heads", "head_width", "feed_forward", "vocabulary")
SIZES = {  # see the module docstring's table
    "gpt2": {"tiny": dict(zip(_GPT2, (2, 128, 4, 512, 1_000, 128))),
             "small": dict(zip(_GPT2, (6, 256, 8, 1_024, 8_000, 512))),
             "base": dict(zip(_GPT2, (12, 768, 12, 3_072, 50_257, 1_024)))},
    "gemma": {"tiny": dict(zip(_GEMMA, (2, 128, 4, 1, 32, 1_024, 1_000))),
              "small": dict(zip(_GEMMA, (6, 256, 8, 1, 32, 2_048, 8_000))),
              "2b": dict(zip(_GEMMA, (18, 2_048, 8, 1, 256, 32_768, 256_000)))},
}
LEARNING_RATES = {"tiny": 1e-3, "small": 6e-4, "base": 3e-4, "2b": 3e-4}  # the default of --learning-rate


@dataclasses.dataclass(frozen=True)
class LMSettings:
    """What ``captioning lm train`` trains: the flags of the same names."""

    architecture: str = "gpt2"
    size: str = "tiny"
    steps: int = 3000
    batch_size: int = 32
    sequence_length: int = 64
    learning_rate: float | None = None  # None: LEARNING_RATES[size]
    seed: int = 0

    def check(self) -> "LMSettings":
        """Self with the learning rate filled in; one line (InputError) for an unknown architecture or size, or a
        sequence longer than the size's positions."""
        if self.architecture not in SIZES:
            raise InputError(f"`architecture` must be one of {', '.join(SIZES)}, got {self.architecture!r}",
                             params=("architecture",))
        sizes = SIZES[self.architecture]
        if self.size not in sizes:
            raise InputError(f"`size` of {self.architecture} must be one of {', '.join(sizes)}, got {self.size!r}",
                             params=("size",))
        positions = sizes[self.size].get("positions")
        if positions and self.sequence_length > positions:
            raise InputError(f"`sequence_length` {self.sequence_length} is longer than the {positions} positions of "
                             f"{self.architecture} {self.size}", params=("sequence_length",))
        return dataclasses.replace(self, learning_rate=self.learning_rate or LEARNING_RATES[self.size])


def held_out_split(sentences: list[str], seed: int) -> tuple[list[str], list[str]]:
    """(training sentences, held-out sentences): one in :data:`HELD_OUT_SHARE` held out (at least one, at most
    :data:`MAX_HELD_OUT`), chosen by ``seed``; both keep the text's order."""
    count = min(MAX_HELD_OUT, max(1, len(sentences) // HELD_OUT_SHARE))
    held = set(np.random.default_rng(seed).permutation(len(sentences))[:count].tolist())
    return ([s for i, s in enumerate(sentences) if i not in held], [s for i, s in enumerate(sentences) if i in held])


def make_tokenizer(architecture: str, parts: dict):
    """The keras-hub tokenizer of ``architecture`` from its parts (GPT-2: ``vocabulary``, ``merges``; Gemma:
    ``proto``)."""
    import keras_hub

    if architecture == "gpt2":
        return keras_hub.models.GPT2Tokenizer(vocabulary=parts["vocabulary"], merges=parts["merges"])
    return keras_hub.models.GemmaTokenizer(proto=parts["proto"])


def build_causal_lm(architecture: str, size: str, tokenizer, sequence_length: int, seed: int):
    """The keras-hub causal LM (backbone of the size, the tokenizer's preprocessor), weights drawn from ``seed``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    s = SIZES[architecture][size]
    vocabulary = tokenizer.vocabulary_size()
    if architecture == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary, num_layers=s["layers"], num_heads=s["heads"], hidden_dim=s["width"],
            intermediate_dim=s["feed_forward"], dropout=0.0, max_sequence_length=s["positions"])
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=sequence_length)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=vocabulary, num_layers=s["layers"], num_query_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], hidden_dim=s["width"], intermediate_dim=s["feed_forward"],
        head_dim=s["head_width"], dropout=0.0)
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=sequence_length)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)


def needs_space(tokenizer) -> bool:
    """Whether a sentence's first word lacks the word-start mark unless a space is put in front (GPT-2's BPE splits
    ``"a red"`` into ``a Ġred``; SentencePiece adds its own ``▁``). The preset tokenizer of a caption decoder
    (:mod:`captioning.data.tokenizers.preset`) puts one there, so every word of a caption is the same pieces
    wherever it stands: the language model learns its sentences so too."""
    first = tokenizer.id_to_token(int(tokenizer(["a"])[0][0]))
    return not first.startswith(("Ġ", "▁"))


def token_streams(tokenizer, *groups: list[str], chunk: int = 8192) -> list[np.ndarray]:
    """Each list of sentences in ``groups`` tokenized (with a space in front where :func:`needs_space`) and packed:
    ``start ids... end`` each, the end left out where it is the start (GPT-2's one token), and an end after the
    last; int32. All groups go through one tf.data pipeline: the tokenizer is traced once (GPT-2's byte-level BPE:
    about 2 CPU s a trace) for the training sentences and the held-out ones.

    >>> import tensorflow as tf
    >>> class Pieces:  # a tokenizer of one piece per letter ("a" is 7), start 1 and end 2
    ...     start_token_id, end_token_id = 1, 2
    ...     def id_to_token(self, i):
    ...         return "▁" + chr(i + 90)  # SentencePiece's word-start mark: no space added
    ...     def __call__(self, texts):
    ...         return tf.strings.unicode_decode(texts, "UTF-8") - 90
    >>> [s.tolist() for s in token_streams(Pieces(), ["ab", "c"])]
    [[1, 7, 8, 2, 1, 9, 2, 2]]
    >>> [s.tolist() for s in token_streams(Pieces(), ["ab"], [], ["c"])]
    [[1, 7, 8, 2, 2], [2], [1, 9, 2, 2]]
    """
    import tensorflow as tf

    start, end = int(tokenizer.start_token_id), int(tokenizer.end_token_id)
    after = int(end != start)
    sentences = [s for group in groups for s in group]
    if needs_space(tokenizer):
        sentences = [" " + s for s in sentences]
    flats, lengths = [np.zeros(0, np.int32)], [np.zeros(0, np.int64)]
    # in tf.data (as in training's input), a keras-hub tokenizer returns a RaggedTensor (eagerly: Python lists)
    chunks = tf.data.Dataset.from_tensor_slices(tf.constant(sentences, tf.string)).batch(chunk).map(
        tf.autograph.experimental.do_not_convert(tokenizer))
    for ragged in chunks if sentences else ():
        flats.append(ragged.flat_values.numpy().astype(np.int32))
        lengths.append(np.diff(ragged.row_splits.numpy()))
    flat, lengths = np.concatenate(flats), np.concatenate(lengths)
    streams, sentence, piece = [], 0, 0
    for group in groups:
        counts = lengths[sentence:sentence + len(group)]
        pieces = flat[piece:piece + int(counts.sum())]
        sentence, piece = sentence + len(group), piece + len(pieces)
        splits = np.concatenate([[0], np.cumsum(counts)])
        count = np.arange(len(counts))
        out = np.empty(len(pieces) + (1 + after) * len(count) + 1, np.int32)
        marks = np.zeros(len(out), bool)
        firsts = splits[:-1] + (1 + after) * count
        marks[firsts], out[firsts] = True, start
        if after:
            lasts = splits[1:] + 2 * count + 1
            marks[lasts], out[lasts] = True, end
        marks[-1], out[-1] = True, end  # the end after the last
        out[~marks] = pieces
        streams.append(out)
    return streams


def windows(stream: np.ndarray, length: int) -> np.ndarray:
    """The stream cut into windows of ``length + 1`` tokens, each starting where the last one's inputs ended
    (``[N, length + 1]``); a stream too short for one is an InputError."""
    count = (len(stream) - 1) // length
    if count < 1:
        raise InputError(f"the text is {len(stream):,} tokens long, too short for one window of `sequence_length` "
                         f"{length} + 1: give more text or a shorter `sequence_length`", params=("sequence_length",))
    index = np.arange(count)[:, None] * length + np.arange(length + 1)[None, :]
    return stream[index]


def unigram_entropy(stream: np.ndarray) -> float:
    """The entropy (nats per token) of the stream's token frequencies: the loss of a model that knows only them."""
    counts = np.bincount(stream[1:])
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _steps(causal_lm, settings: LMSettings):
    """The compiled training step and the held-out loss over a batch of windows (mean NLL, token count)."""
    import keras
    import tensorflow as tf

    warmup = min(1000, settings.steps // 10)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0 if warmup else settings.learning_rate, decay_steps=max(1, settings.steps - warmup), alpha=0.1,
        warmup_target=settings.learning_rate if warmup else None, warmup_steps=warmup)
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0)
    variables = causal_lm.trainable_variables

    def nll(batch, weights, training):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = causal_lm({"token_ids": inputs, "padding_mask": tf.ones_like(inputs, tf.bool)}, training=training)
        losses = keras.losses.sparse_categorical_crossentropy(targets, tf.cast(logits, tf.float32), from_logits=True)
        return tf.reduce_sum(losses * weights), tf.reduce_sum(weights)

    def train_step(batch):
        with tf.GradientTape() as tape:
            total, count = nll(batch, tf.ones(tf.shape(batch[:, 1:]), tf.float32), True)
            loss = total / count
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    def held_out(batch, weights):
        return nll(batch, weights, False)

    return (tf.function(train_step, autograph=False, reduce_retracing=True),
            tf.function(held_out, autograph=False, reduce_retracing=True))


def _held_out_loss(held_out, stream: np.ndarray, length: int, batch_size: int) -> float:
    """Mean NLL per token of the held-out stream: its full windows, and the rest padded (padding weighs 0)."""
    full = (len(stream) - 1) // length
    rows = [stream[i * length:i * length + length + 1] for i in range(full)]
    rest = stream[full * length:]
    weights = [np.ones(length, np.float32)] * full
    if len(rest) > 1:
        rows.append(np.pad(rest, (0, length + 1 - len(rest))))
        weights.append((np.arange(length) < len(rest) - 1).astype(np.float32))
    total = count = 0.0
    for i in range(0, len(rows), batch_size):
        t, c = held_out(np.stack(rows[i:i + batch_size]), np.stack(weights[i:i + batch_size]))
        total, count = total + float(t), count + float(c)
    return total / max(count, 1.0)


def _train(train_step, data: np.ndarray, settings: LMSettings, progress: bool) -> list[float]:
    """Runs the steps over windows drawn in a seeded order; the losses."""
    from tqdm import tqdm

    rng = np.random.default_rng(settings.seed)
    order = np.empty(0, np.int64)
    losses, every, started = [], max(1, settings.steps // 10), time.perf_counter()
    bar = tqdm(total=settings.steps, desc="lm train", unit="step", disable=None if progress else True, mininterval=1)
    for step in range(1, settings.steps + 1):
        while len(order) < settings.batch_size:  # every window once an epoch
            order = np.concatenate([order, rng.permutation(len(data))])
        picked, order = order[:settings.batch_size], order[settings.batch_size:]
        losses.append(float(train_step(data[picked])))
        if not math.isfinite(losses[-1]):
            raise InputError(f"the loss is {losses[-1]} at step {step}: try a smaller `learning_rate`",
                             params=("learning_rate",))
        bar.update(1)
        if step % every == 0 or step == settings.steps:
            recent = float(np.mean(losses[-every:]))
            bar.set_postfix(loss=f"{recent:.3f}", refresh=False)
            log.info("step %d of %d: loss %.3f (%.1f steps/s)", step, settings.steps, recent,
                     step / (time.perf_counter() - started))
    bar.close()
    return losses


def _continuation(causal_lm, prompt: str) -> str:
    """The causal LM's greedy continuation of ``prompt`` (keras-hub's own ``generate``)."""
    causal_lm.compile(sampler="greedy")
    space = " " if needs_space(causal_lm.preprocessor.tokenizer) else ""
    return str(causal_lm.generate(space + prompt, max_length=causal_lm.preprocessor.sequence_length)).strip()


def train_language_model(sentences: list[str], parts: dict, settings: LMSettings, output: str, text: dict,
                         progress: bool = True) -> dict:
    """Trains the causal LM ``settings`` describes on ``sentences`` (normalised) with the tokenizer made of
    ``parts`` and writes it, with :data:`RECORD` (``settings``, ``text``: the text's identity, the figures), to
    the preset folder ``output`` through a temporary folder. Returns the record."""
    settings = settings.check()
    training, held = held_out_split(sentences, settings.seed)
    # shuffled before packing: a window's sentences are unrelated (a text's neighbours, such as one image's five
    # captions, would teach copying from the context, which a caption after a visual prefix never has)
    training = [training[i] for i in np.random.default_rng([settings.seed, 1]).permutation(len(training))]
    tokenizer = make_tokenizer(settings.architecture, parts)
    stream, held_stream = token_streams(tokenizer, training, held)
    data = windows(stream, settings.sequence_length)
    causal_lm = build_causal_lm(settings.architecture, settings.size, tokenizer, settings.sequence_length,
                                settings.seed)
    log.info("%s %s: %s parameters, %s pieces; %s training sentences (%s tokens, %s windows of %d), %s held out",
             settings.architecture, settings.size, f"{causal_lm.backbone.count_params():,}",
             f"{tokenizer.vocabulary_size():,}", f"{len(training):,}", f"{len(stream):,}", f"{len(data):,}",
             settings.sequence_length, f"{len(held):,}")
    train_step, held_out = _steps(causal_lm, settings)
    started = time.perf_counter()
    losses = _train(train_step, data, settings, progress)
    seconds = time.perf_counter() - started
    held_loss = _held_out_loss(held_out, held_stream, settings.sequence_length, settings.batch_size)
    prompt = " ".join(held[0].split()[:2])
    last = min(100, max(1, settings.steps // 10))  # the run's last tenth, at most 100 steps
    figures = {"final_loss": float(np.mean(losses[-last:])), "first_loss": losses[0],
               "unigram_entropy": unigram_entropy(stream), "held_out_loss": held_loss,
               "held_out_perplexity": math.exp(min(held_loss, 700.0)), "train_seconds": round(seconds, 1),
               "parameters": int(causal_lm.backbone.count_params()),
               "vocabulary_size": int(tokenizer.vocabulary_size()), "training_sentences": len(training),
               "training_tokens": int(len(stream)), "held_out_sentences": len(held),
               "continuation": {"prompt": prompt, "greedy": _continuation(causal_lm, prompt)}}
    log.info("final training loss %.3f (unigram entropy %.3f); held out: loss %.3f, perplexity %.2f; %d steps in "
             "%.0f s", figures["final_loss"], figures["unigram_entropy"], held_loss, figures["held_out_perplexity"],
             settings.steps, seconds)
    log.info("greedy continuation of %r: %r", prompt, figures["continuation"]["greedy"])
    record = {"settings": dataclasses.asdict(settings), "text": text, "figures": figures}
    with atomic_folder(output) as folder:
        causal_lm.save_to_preset(folder)
        atomic_write_json(os.path.join(folder, RECORD), record)
    return record


def finished(output: str) -> dict | None:
    """The :data:`RECORD` of a preset this command wrote in ``output``, or None."""
    return read_record(os.path.join(output, RECORD), ("settings", "text"))
