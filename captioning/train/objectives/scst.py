"""Self-critical sequence training (Rennie et al. 2017): ``train.objective: scst``, the ``scst:`` section.

For each image of a replica's batch the model *samples* ``scst.samples`` captions with its own decoding
step (any decoder: :meth:`captioning.model.base.CaptionModel.step`), each caption is rewarded with its
CIDEr-D against the image's references (:class:`captioning.train.cider.CiderD`, in TensorFlow ops, with
document frequencies of the training references), and the policy gradient pushes up the captions that
beat a baseline and down the others::

    loss = − Σ_samples (r − b) · Σ_words log p(word)        divided by the global number of samples

* ``baseline: mean`` (default; self-critical.pytorch's "new SCST"): b of a sample is the mean reward of
  the image's *other* samples, so no extra decoding is needed (``samples`` ≥ 2).
* ``baseline: greedy`` (Rennie et al.): b is the reward of the image's greedy caption, decoded in the
  same step without gradient.

**Sampling**, in the graph: ``samples`` rows per image, ``max_length`` steps of the decoder; at each step
a word is drawn from ``softmax(logits / temperature)`` (``<pad>`` and ``<start>`` excluded) by inverse
CDF with one uniform number per row. A row stops at ``<end>`` (the ``<end>`` counts in its log-probability,
the steps after it are masked out); a row still going after ``max_length`` words stops there without
one. The uniform numbers are drawn for the *global* batch from a seed of (``train.seed``, the step, the
word position) and each replica takes its rows' share (its offset comes from an all-reduce of the
replicas' row counts), so the samples are the same whatever the number of replicas, and two mirrored
replicas compute exactly what one device computes on both batches (tested).

**The reward's words** (``scst.end_in_reward``, default true): the n-grams include ``<end>``, appended to
every reference and counted in a sample that chose it, as self-critical.pytorch appends ``<eos>``.
Without it a caption that runs on to ``max_length`` or stops mid-phrase ("a red circle and a") loses
nothing for the missing ending, and sampling learns to stop less and less (seen here on the shapes
data: the share of samples ending with ``<end>`` fell from 0.95 to 0.77 in 20 steps).

**The gradient**: for a decoder whose teacher-forced pass is cheaper than stepping
(:attr:`captioning.model.base.CaptionModel.fast_teacher_forcing`: Show and Tell, the Transformer) the captions
are drawn without gradient, then their log-probabilities are computed again in one teacher-forced pass
(:func:`sequence_log_prob`), which the policy gradient goes through. The backward pass through a
``max_length``-step sampling loop (whose every step's activations a tape must keep) is what makes SCST slow in
the reference codebases; the teacher-forced pass is a cross-entropy step's, for the Transformer parallel over
the words (its SCST step fell from 5.5x to 2.4x a cross-entropy step per image on the shapes data). A decoder
that steps in its teacher-forced pass too (soft attention, Up-Down) is differentiated through the sampling
loop, which costs it less than a second pass. Same loss, same gradient either way (tested).

**Normalisation**: the loss is a mean per sampled caption over the global batch (the ``weight`` is the
number of samples), so the learning rate means the same for any batch size and caption length.
Reported per sample (TensorBoard ``train/``): ``reward`` (mean CIDEr-D of the samples), ``baseline``,
``ended`` (the share of samples that chose ``<end>``).

**Batches**: SCST needs every reference of an image in the batch, so it trains on grouped batches
(``data.captions_per_image: grouped``, all captions): ``train.batch_size`` still counts captions, and a
batch holds ``round(batch_size / captions per image)`` images, each sampled ``scst.samples`` times. The
attention decoder's doubly stochastic penalty belongs to cross-entropy training and is not added.
Dropout is off while sampling (the decoders' step runs in inference mode).
"""

from __future__ import annotations

import tensorflow as tf

from captioning.config import ScstConfig
from captioning.train.cider import CiderD, caption_lengths
from captioning.model.base import pad_rows
from captioning.train.objectives.base import Objective, ReplicaLoss, RunContext
from captioning.vocab import END_ID, PAD_ID, START_ID

_NEVER = -1e9


def references_of(batch: dict, end_token: bool = False) -> tf.RaggedTensor:
    """A grouped batch's references as word ids ``[images, (captions), (words)]``: each caption's target
    ids without padding (and without their final ``<end>`` unless ``end_token``), grouped by
    ``image_index``."""
    lengths = tf.cast(tf.reduce_sum(batch["mask"], axis=1), tf.int32) - (0 if end_token else 1)
    words = tf.RaggedTensor.from_tensor(tf.cast(batch["target_ids"], tf.int32), lengths=tf.maximum(lengths, 0))
    images = tf.shape(batch[next(key for key in ("image", "features", "regions") if key in batch)])[0]
    return tf.RaggedTensor.from_value_rowids(words, tf.cast(batch["image_index"], tf.int64),
                                             nrows=tf.cast(images, tf.int64))


def _global_rows(rows):
    """(this replica's first row in the global batch, the global batch's rows)."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    mine = tf.one_hot(ctx.replica_id_in_sync_group, replicas, dtype=tf.int32) * rows
    counts = ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine) if replicas > 1 else mine
    return tf.reduce_sum(counts * tf.cast(tf.range(replicas) < ctx.replica_id_in_sync_group, tf.int32)), \
        tf.reduce_sum(counts)


def sample_captions(model, state, max_length: int, temperature: float, seed, xla: bool = False) -> dict:
    """``state``'s rows decoded by sampling (see the module docstring); ``seed`` is an int32 ``[2]`` for the
    step. Returns ``{"ids": int32 [rows, max_length] (words, then <end> or <pad>), "log_prob": float32 [rows]
    (summed over the words and the <end>, differentiable), "ended": bool [rows]}``.

    ``xla`` (``scst.xla_sampling``) compiles the loop with XLA, to draw without gradient: a step of a small
    decoder is dozens of small ops, whose dispatch XLA fuses away (the shapes Transformer's 20 steps for 65
    rows: 158 → 52 ms on 2 CPU cores). Then there is no ``log_prob`` (:func:`sequence_log_prob` scores the
    ids): the compiled call returns integers only, which a gradient tape does not follow into the loop. The
    uniform numbers are drawn before the loop, so the samples are the same either way (tested)."""
    state = model.reserve(state, max_length)
    rows = tf.shape(tf.nest.flatten(state)[0])[0]
    offset, total = _global_rows(rows)
    uniforms = tf.stack([tf.random.stateless_uniform([total], seed=tf.random.experimental.stateless_fold_in(seed, t))
                         for t in range(max_length)])[:, offset:offset + rows]  # [max_length, rows]

    def draw(state, uniforms):
        rows, vocab = tf.shape(uniforms)[1], model.vocab_size  # (its own: XLA needs the shapes of its inputs)
        never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], vocab), axis=0) * _NEVER
        shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
        tokens = tf.fill([rows], tf.constant(START_ID, tf.int32))
        going = tf.ones([rows], tf.bool)
        log_prob = tf.zeros([rows])
        ids = tf.TensorArray(tf.int32, size=max_length)
        for t in tf.range(max_length):
            tf.autograph.experimental.set_loop_options(
                shape_invariants=list(zip(tf.nest.flatten(state), tf.nest.flatten(shapes))))
            logits, state = model.step(tokens, state)
            logp = tf.nn.log_softmax(tf.cast(logits, tf.float32) / temperature + never)
            cdf = tf.cumsum(tf.exp(logp), axis=1)
            word = tf.minimum(tf.reduce_sum(tf.cast(cdf < uniforms[t][:, None] * cdf[:, -1:], tf.int32), axis=1),
                              vocab - 1)
            chosen = tf.gather(logp, word, batch_dims=1)
            log_prob += tf.where(going, chosen, 0.0)
            word = tf.where(going, word, PAD_ID)
            ids = ids.write(t, word)
            going = tf.logical_and(going, tf.not_equal(word, END_ID))
            tokens = word
        ids = tf.transpose(ids.stack())
        return {"ids": ids, "log_prob": log_prob, "ended": tf.reduce_any(tf.equal(ids, END_ID), axis=1)}

    if not xla:
        return draw(state, uniforms)
    integers = tf.function(lambda state, uniforms: {k: v for k, v in draw(state, uniforms).items() if k != "log_prob"},
                           jit_compile=True)
    padded = tf.maximum(rows, 1)  # a decoder never sees an empty batch (an empty replica's share)
    out = integers(tf.nest.map_structure(lambda s: pad_rows(s, padded), state),
                   tf.transpose(pad_rows(tf.transpose(uniforms), padded)))
    return {k: v[:rows] for k, v in out.items()}


def sequence_log_prob(model, state, ids, temperature: float):
    """The summed log-probability ``float32 [rows]`` of each row's caption ``ids [rows, T]`` (words, then
    ``<end>`` or ``<pad>``, as :func:`sample_captions` draws them) under ``softmax(logits / temperature)``
    with ``<pad>`` and ``<start>`` excluded, over its words and its ``<end>``: one teacher-forced pass from
    ``state`` (a Transformer's is parallel over the words), differentiable. It equals the log-probability
    the sampling loop adds up (the decoder contract: stepping equals teacher forcing; tested)."""
    rows, steps = tf.shape(ids)[0], tf.shape(ids)[1]
    inputs = tf.concat([tf.fill([rows, 1], START_ID), ids[:, :-1]], axis=1)
    padded = tf.maximum(rows, 1)  # a decoder never sees an empty batch (an empty replica's share)
    state = tf.nest.map_structure(lambda s: pad_rows(s, padded), state)
    logits, _ = model.teacher_forced(state, pad_rows(inputs, padded), training=False)
    never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], model.vocab_size), axis=0) * _NEVER
    logp = tf.nn.log_softmax(tf.cast(logits[:rows], tf.float32) / temperature + never)
    chosen = tf.gather(logp, ids, batch_dims=2)
    # the words up to and with the first <end>
    counted = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, END_ID), tf.int32), axis=1, exclusive=True), 0)
    return tf.reduce_sum(tf.where(counted, chosen, 0.0), axis=1)


def greedy_captions(model, state, max_length: int) -> tf.Tensor:
    """Greedy ids ``int32 [rows, max_length]`` (words, then <end> or <pad>), without gradient."""
    from captioning.model.decode import beam_search

    state = tf.nest.map_structure(tf.stop_gradient, state)
    best = beam_search(model, None, beam_size=1, max_length=max_length, initial_state=state)
    ids, lengths = best["ids"][:, 0], best["lengths"][:, 0]
    return tf.where(tf.range(max_length)[None, :] < lengths[:, None], ids, PAD_ID)


class SelfCritical(Objective):
    """``train.objective: scst`` (see the module docstring)."""

    name = "scst"
    # every reference of an image in the batch: whole images with all their captions
    needs = {"captions_per_image": "grouped", "group_captions": 0}
    parts = ("reward", "baseline", "ended")
    xla = False  # its sampling stops captions at <end>, and the reward's lookup table runs on the host

    def __init__(self, cider: CiderD, cfg: ScstConfig, step: tf.Variable, seed: int = 0):
        self.cider, self.cfg, self.step, self.seed = cider, cfg, step, seed

    @classmethod
    def for_run(cls, context: RunContext) -> "SelfCritical":
        """The objective of a training run: document frequencies of the training split's references (with
        ``<end>`` when ``scst.end_in_reward``) from the model folder's file, counted and saved there (by
        the chief) when it is missing or was counted from other data."""
        import dataclasses
        import logging
        import os

        from captioning.train.document_frequencies import DocumentFrequencies, frequencies_from_split

        cfg, dataset, shards, chief = context.cfg, context.dataset, context.shards, context.chief
        frequencies_file, step = context.folder.document_frequencies_file, context.step
        end = cfg.scst.end_in_reward
        source = f"{dataset.identity}:{cfg.data.train_split}" + (":end" if end else "")
        frequencies = DocumentFrequencies.load(frequencies_file) if os.path.exists(frequencies_file) else None
        if (frequencies is None or frequencies.source != source or frequencies.vocab_size != dataset.vocab_size
                or not frequencies.word_counts.size):
            logging.getLogger("captioning.train").info(
                "counting the n-grams of the %s references for the CIDEr-D reward (once)", cfg.data.train_split)
            frequencies = frequencies_from_split(dataset, cfg.data.train_split, shards=shards, end_token=end)
            frequencies = dataclasses.replace(frequencies, source=source)
            if chief:
                frequencies.save(frequencies_file)
        cut = frequencies.share_longer(cfg.scst.max_length)
        if cut > 0.01:  # COCO: ~1% of its references are longer than 16 words; shapes: 9% (3 shapes)
            logging.getLogger("captioning.train").warning(
                "%.1f%% of the %s references have more than scst.max_length=%d words: samples are cut there and "
                "rewarded cut, which teaches the model to leave things out; raise scst.max_length",
                100 * cut, cfg.data.train_split, cfg.scst.max_length)
        return cls(CiderD(frequencies), cfg.scst, step, seed=cfg.train.seed)

    def sample_notes(self, best: dict, captions: tf.RaggedTensor) -> list[str]:
        """Each sample caption's reward (TensorBoard's sample captions under SCST)."""
        return [f"reward {r:.3f}" for r in self.rewards_of(best, captions)]

    @classmethod
    def measure(cls, cfg, images: float, references: float, step_ms: float) -> dict:
        """The CIDEr-D reward alone, timed on captions of the step's sizes (a replica's images, the samples
        — and the greedy captions with ``scst.baseline: greedy`` —, the references per image,
        ``scst.max_length`` words, the model's vocabulary), and its share of the step.
        :func:`captioning.train.cider.benchmark` says how the cost scales."""
        from captioning.data.prepared import PreparedDataset
        from captioning.train.cider import benchmark

        vocab = PreparedDataset.load(cfg.data.dir).vocab_size
        samples = cfg.scst.samples - (1 if cfg.scst.baseline == "mean" else 0)  # benchmark adds one per image
        timed = benchmark(images=max(1, round(images)), samples=samples, references=max(1, round(references)),
                          length=cfg.scst.max_length + int(cfg.scst.end_in_reward), vocab_size=vocab,
                          table_keys=200_000)
        return {"reward_ms": timed["ms"], "reward_share": timed["ms"] / step_ms}

    @classmethod
    def summarize(cls, figures: dict) -> str:
        return (f"the CIDEr-D reward alone: {figures['reward_ms']:.1f} ms, {figures['reward_share']:.1%} of the step "
                "(target <= 10%)")

    def rewards_of(self, best: dict, captions: tf.RaggedTensor):
        """The reward of each image's best caption of a beam search (``best``) against the image's
        references (``captions``: the records' ids, ``[images, (captions), (ids)]``), as a NumPy array."""
        end = self.cfg.end_in_reward
        words, lengths = best["ids"][:, 0], best["lengths"][:, 0]
        ended = lengths < tf.shape(words)[1]  # stopped at <end> before the longest caption allowed
        if end:  # <end> after the words, as the reward counts it
            words = tf.pad(words, [[0, 0], [0, 1]])
            words += END_ID * tf.one_hot(lengths, tf.shape(words)[1], dtype=words.dtype) * tf.cast(ended, words.dtype)[:, None]
            lengths += tf.cast(ended, lengths.dtype)
        references = tf.cast(captions[:, :, 1:] if end else captions[:, :, 1:-1], tf.int32)
        return self.cider.scores(words, lengths, references).numpy()

    def _lengths(self, ids):
        """Words scored per caption: its words, and its ``<end>`` when it has one and the reward counts it."""
        words = caption_lengths(ids)
        if not self.cfg.end_in_reward:
            return words
        return words + tf.cast(tf.reduce_any(tf.equal(ids, END_ID), axis=1), tf.int32)

    def replica_loss(self, model, batch, training):
        features, mask = model.image_features(batch, training=training)
        end = self.cfg.end_in_reward
        references = references_of(batch, end_token=end)
        n, s = tf.shape(features)[0], self.cfg.samples
        state = model.initial_state(features, training=False, mask=mask)
        repeated = tf.nest.map_structure(lambda x: tf.repeat(x, s, axis=0), state)
        seed = tf.stack([tf.constant(self.seed, tf.int32), tf.cast(self.step, tf.int32)])
        if model.fast_teacher_forcing:  # drawn without gradient, scored in one teacher-forced pass
            drawn = sample_captions(model, tf.nest.map_structure(tf.stop_gradient, repeated), self.cfg.max_length,
                                    self.cfg.temperature, seed, xla=self.cfg.xla_sampling)
            log_prob = sequence_log_prob(model, repeated, drawn["ids"], self.cfg.temperature)
        else:  # the policy gradient through the sampling loop itself
            drawn = sample_captions(model, repeated, self.cfg.max_length, self.cfg.temperature, seed)
            log_prob = drawn["log_prob"]
        index = tf.repeat(tf.range(n), s)
        reward = self.cider.scores(drawn["ids"], self._lengths(drawn["ids"]), references, index)
        per_image = tf.reshape(reward, [n, s])
        if self.cfg.baseline == "mean":  # the other samples of the same image
            baseline = (tf.reduce_sum(per_image, axis=1, keepdims=True) - per_image) / (s - 1)
            baseline = tf.reshape(baseline, [-1])
        else:  # the greedy caption's reward, per image
            greedy = greedy_captions(model, state, self.cfg.max_length)
            greedy_reward = self.cider.scores(greedy, self._lengths(greedy), references, tf.range(n))
            baseline = tf.repeat(greedy_reward, s)
        advantage = tf.stop_gradient(reward - baseline)
        loss_sum = -tf.reduce_sum(advantage * log_prob)
        samples = tf.cast(n * s, tf.float32)
        return ReplicaLoss(loss_sum, samples, {"reward": tf.reduce_sum(reward), "baseline": tf.reduce_sum(baseline),
                                               "ended": tf.reduce_sum(tf.cast(drawn["ended"], tf.float32))})
