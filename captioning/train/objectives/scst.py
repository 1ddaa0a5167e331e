"""Self-critical sequence training (Rennie et al. 2017): ``train.objective: scst``, and its ``scst:`` section
(:class:`ScstSettings`).

For each image of a replica's batch the model *samples* ``scst.samples`` captions with its own decoding
step (any decoder: :meth:`captioning.model.base.CaptionModel.step`), each caption is rewarded with its
CIDEr-D against the image's references (:class:`captioning.train.cider.CiderD`, in TensorFlow ops, with
document frequencies of the training references), and the policy gradient pushes up the captions that
beat a baseline and down the others::

    loss = − Σ_samples (r − b) · Σ_words log p(word)        divided by the global number of samples

* ``baseline: mean`` (default; self-critical.pytorch's "new SCST"): b of a sample is the mean reward of
  the image's *other* samples, so no extra decoding is needed (``samples`` ≥ 2).
* ``baseline: greedy`` (Rennie et al.): b is the reward of the image's greedy caption, decoded in the
  same step without gradient and scored exactly as a sample of the same words (its ``<end>`` written
  after its words when it chose one, and counted with ``end_in_reward``), so a sample identical to the
  greedy caption has advantage 0 (tested).

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

**A subword tokenizer** (a language-model decoder's pieces; the run's tokenizer, ``RunContext.tokenizer``): the
reward scores the words the pieces spell, not the pieces (:mod:`captioning.train.reward_words`): samples and
references are detokenized and split into words in the graph and looked up in the prepared vocabulary, so the
references and the document frequencies are a word decoder's and a caption string earns the same reward whichever
tokenizer wrote it. ``scst.max_length`` then counts pieces.

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

**A cross-entropy term** (``scst.xe_weight`` w, default 0: SCST alone, as self-critical.pytorch and Rennie et
al.): several SCST follow-ups mix the references' cross-entropy back in to keep the captions fluent. The two
terms keep their own natural means, each over the global batch::

    loss = SCST's mean per sample + w × the references' cross-entropy mean per real token

(the plain cross-entropy of every reference of the batch's images, teacher-forced in training mode, without
label smoothing or the attention penalty). The step divides every replica's loss sum by the global number of
samples S, so a replica adds ``w · CE_sum · S / T`` with T the global batch's real tokens (both all-reduced in
:meth:`SelfCritical.replica_loss`); a replica with no reference adds nothing. Reported as ``xe`` (TensorBoard
``train/xe``: the cross-entropy mean per token, unweighted) when w > 0. With ``train.accumulate_steps`` the term is
each micro-batch's mean per token, weighted by its share of the step's samples. The references' forward pass
encodes the images a second time (the samples' pass runs the encoder in its own mode).

**The reward** (``scst.reward``): ``cider``, CIDEr-D as above; ``clip``, Cho et al.'s CLIP reward: CLIP-S (2.5 ·
max(cos, 0)) of each sample with its image, from the frozen CLIP or SigLIP preset ``scst.clip_preset``, computed in
the step (:mod:`captioning.train.clip_reward`: the words' pieces packed as the preset packs the prefixed text, the
image embedded once per image; it equals ``evaluate --clip-preset``'s ``clip_score`` for the same caption and
pixels); ``mix``, CIDEr-D + ``scst.clip_weight`` · CLIP-S. The baselines are the same, of the same reward. The
images are the batch's crops, so ``data.cache: features`` (no pixels) is refused. Reported as ``clip_s`` (the
samples' mean CLIP-S) beside ``reward``.

**Batches**: SCST needs every reference of an image in the batch, so it trains on grouped batches
(``data.captions_per_image: grouped``, all captions): ``train.batch_size`` still counts captions, and a
batch holds ``round(batch_size / captions per image)`` images, each sampled ``scst.samples`` times. The
attention decoder's doubly stochastic penalty belongs to cross-entropy training and is not added.
Dropout is off while sampling (the decoders' step runs in inference mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

from captioning.errors import InputError
from captioning.config.settings import MAX_BEAM, MAX_FACTOR, MAX_TEMPERATURE, MAX_WORDS, Section, between, choices
from captioning.train.cider import CiderD, caption_lengths
from captioning.train.reward_words import reward_words
from captioning.train.objectives.base import Objective, ReplicaLoss, RunContext, caption_loss_sum, step_seed
from captioning.train.objectives.scst_cost import breakdown, describe
from captioning.train.objectives.scst_sampling import (as_drawn, greedy_captions, references_of, sample_captions,
                                                       sequence_log_prob)
from captioning.vocab import END_ID


@dataclass
class ScstSettings(Section):
    """The ``scst:`` section: the settings of self-critical sequence training (``train.objective: scst``;
    the module docstring). Typed by :func:`captioning.train.objectives.resolve` whichever objective a run
    trains with, so a wrong key or value is refused even where SCST does not run."""

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
    # a cross-entropy term of the image's references added to the SCST loss with this weight (several SCST
    # follow-ups mix it in to keep the captions fluent); 0: SCST alone, as self-critical.pytorch
    xe_weight: float = field(default=0.0, metadata=between(0.0, MAX_FACTOR))
    # cider: CIDEr-D; clip: CLIP-S from clip_preset (Cho et al. 2022); mix: CIDEr-D + clip_weight × CLIP-S
    reward: str = field(default="cider", metadata=choices("cider", "clip", "mix"))
    # a keras-hub CLIP or SigLIP preset (a folder, or a name keras-hub downloads); read by reward clip and mix only
    clip_preset: str = ""
    clip_weight: float = field(default=1.0, metadata=between(0.0, MAX_FACTOR))  # mix's weight of CLIP-S

    def check(self, prefix: str = "scst.") -> None:
        if self.baseline == "mean" and self.samples < 2:
            raise InputError(f"{prefix}samples ({self.samples}) must be at least 2 with {prefix}baseline: mean (the "
                             "baseline of a sample is the mean of the image's other samples)")
        if self.reward != "cider" and not self.clip_preset:
            raise InputError(f"{prefix}reward {self.reward} needs {prefix}clip_preset: a keras-hub CLIP or SigLIP "
                             f"preset (captioning clip train writes one)")


class SelfCritical(Objective):
    """``train.objective: scst`` (see the module docstring)."""

    name = "scst"
    settings_class = ScstSettings
    # every reference of an image in the batch: whole images with all their captions
    needs = {"captions_per_image": "grouped", "group_captions": 0}
    parts = ("reward", "baseline", "ended")
    xla = False  # its sampling stops captions at <end>, and the reward's lookup table runs on the host

    def __init__(self, cider: CiderD, cfg: ScstSettings, step: tf.Variable, seed: int = 0,
                 split_padding: bool = False, words=None, clip=None):
        self.cider, self.cfg, self.step, self.seed = cider, cfg, step, seed
        self.clip = clip  # scst.reward clip or mix: the CLIP reward (captioning.train.clip_reward.ClipReward)
        # a subword tokenizer's captions as word ids (captioning.train.reward_words.RewardWords; None: ids are words)
        self.words = words
        self.split_padding = split_padding  # the references' teacher-forced pass (scst.xe_weight)
        if cfg.xe_weight > 0:  # the cross-entropy term, reported apart (TensorBoard train/xe)
            self.parts = type(self).parts + ("xe",)
        if clip is not None:  # the samples' CLIP-S, reported apart (TensorBoard train/clip_s)
            self.parts = self.parts + ("clip_s",)

    @classmethod
    def caption_lengths(cls, cfg) -> dict[str, int]:
        return {"scst.max_length": cfg.scst.max_length}  # the samples' and the greedy baseline's words

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
        if cfg.train.scheduled_sampling.enabled:  # said once, not refused: a config may serve both stages
            logging.getLogger("captioning.train").warning(
                "train.scheduled_sampling is not used under train.objective: scst: its captions are the model's own "
                "samples already (scst.xe_weight's references are teacher-forced)")
        words = reward_words(context.tokenizer, dataset, cfg.scst.max_length)
        return cls(CiderD(frequencies, extra_ids=words.extra if words else 0), cfg.scst, step, seed=cfg.train.seed,
                   split_padding=cfg.train.split_padding, words=words, clip=cls._clip_reward(cfg, dataset))

    @staticmethod
    def _clip_reward(cfg, dataset):
        """``scst.reward`` clip or mix: the CLIP reward over the dataset's words (None for cider)."""
        if cfg.scst.reward == "cider":
            return None
        from captioning.model.contrastive import ContrastiveModel
        from captioning.model.data_sources import data_source

        if cfg.data.cache == "features" or not data_source(cfg).pixels:
            held = "data.cache: features" if cfg.data.cache == "features" else f"data.features: {cfg.data.features}"
            raise InputError(f"scst.reward {cfg.scst.reward} reads the images, and {held} holds none: use "
                             "data.features: images and data.cache memory, disk or none")
        from captioning.train.clip_reward import ClipReward, vocabulary_words

        return ClipReward(ContrastiveModel(cfg.scst.clip_preset, key="scst.clip_preset"),
                          vocabulary_words(dataset.vocabulary()))

    def sample_notes(self, best: dict, captions: tf.RaggedTensor, images=None) -> list[str]:
        """Each sample caption's reward (TensorBoard's sample captions under SCST; ``images``: the batch's, which
        the CLIP reward reads)."""
        return [f"reward {r:.3f}" for r in self.rewards_of(best, captions, images)]

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

    def breakdown(self, model, batch: dict) -> dict:
        """Each part of the step timed alone on ``batch`` (:mod:`captioning.train.objectives.scst_cost`)."""
        parts = breakdown(self, model, batch)
        return {"parts_ms": parts, "note": describe(parts, model.fast_teacher_forcing, self.cfg.xla_sampling,
                                                    self.cfg.baseline == "greedy")}

    def rewards_of(self, best: dict, captions: tf.RaggedTensor, images=None):
        """The reward of each image's best caption of a beam search (``best``) against the image's
        references (``captions``: the records' ids, ``[images, (captions), (ids)]``: words whatever the
        tokenizer) and, for the CLIP reward, its image (``images``), as a NumPy array: scored as a sample of the
        same words (or pieces) is."""
        ids = as_drawn(best["ids"][:, 0], best["lengths"][:, 0])
        references = tf.cast(captions[:, :, 1:] if self.cfg.end_in_reward else captions[:, :, 1:-1], tf.int32)
        return self.score(ids, references, images=self.embedded(images))["reward"].numpy()

    def embedded(self, images):
        """What :meth:`score` reads of the batch's ``images``: their CLIP embeddings for the CLIP reward (one row an
        image), None for CIDEr-D (whose batches may hold no pixels: ``images`` None)."""
        return self.clip.image_embeddings(images) if self.clip is not None else None

    def references(self, batch: dict) -> tf.RaggedTensor:
        """A grouped batch's references as the reward's word ids ``[images, (captions), (words)]`` (with ``<end>``
        when ``end_in_reward``): the target ids, or a subword tokenizer's pieces made words."""
        if self.words is None:
            return references_of(batch, end_token=self.cfg.end_in_reward)
        return self.words.references(references_of(batch), self.cfg.end_in_reward)

    def scored_lengths(self, ids):
        """Words scored per caption: its words, and its ``<end>`` when it has one and the reward counts it."""
        words = caption_lengths(ids)
        if not self.cfg.end_in_reward:
            return words
        return words + tf.cast(tf.reduce_any(tf.equal(ids, END_ID), axis=1), tf.int32)

    def score(self, ids, references, index=None, images=None) -> dict:
        """The reward ``[rows]`` of captions ``ids`` as :func:`sample_captions` draws them (words, then ``<end>``
        or ``<pad>``) against ``references`` (:meth:`references`: word ids; of image ``index`` of each row) and,
        for the CLIP reward, the images' embeddings ``images`` (of image ``index`` of each row): samples and the
        greedy baseline alike, ``{"reward"}`` and the CLIP reward's ``"clip_s"``. A subword tokenizer's pieces are
        scored as the words they spell (:mod:`captioning.train.reward_words`)."""
        if self.words is not None:
            words, lengths = self.words.candidates(ids, self.cfg.end_in_reward)
        else:
            words, lengths = ids, self.scored_lengths(ids)
        if self.clip is None:
            return {"reward": self.cider.scores(words, lengths, references, index)}
        clip_s = self.clip(images if index is None else tf.gather(images, index), words, lengths)  # <end>: no pieces
        if self.cfg.reward == "clip":
            return {"reward": clip_s, "clip_s": clip_s}
        cider = self.cider.scores(words, lengths, references, index)
        return {"reward": cider + self.cfg.clip_weight * clip_s, "clip_s": clip_s}

    def rewards(self, model, batch, training=False) -> dict:
        """The step's samples and what the policy gradient weighs them by: per sample ``ids``, ``reward``,
        ``baseline``, ``log_prob`` and ``ended`` (``[images × samples]``, image-major), and with
        ``baseline: greedy`` the images' greedy captions ``greedy`` (as drawn: :func:`as_drawn`)."""
        features, mask = model.image_features(batch, training=training)
        references = self.references(batch)
        n, s = tf.shape(features)[0], self.cfg.samples
        state = model.initial_state(features, training=False, mask=mask)
        repeated = tf.nest.map_structure(lambda x: tf.repeat(x, s, axis=0), state)
        seed = step_seed(self.seed, self.step, batch)  # (train.seed, step), and the micro-batch's index
        if model.fast_teacher_forcing:  # drawn without gradient, scored in one teacher-forced pass
            drawn = sample_captions(model, tf.nest.map_structure(tf.stop_gradient, repeated), self.cfg.max_length,
                                    self.cfg.temperature, seed, xla=self.cfg.xla_sampling)
            log_prob = sequence_log_prob(model, repeated, drawn["ids"], self.cfg.temperature)
        else:  # the policy gradient through the sampling loop itself
            drawn = sample_captions(model, repeated, self.cfg.max_length, self.cfg.temperature, seed)
            log_prob = drawn["log_prob"]
        images = self.embedded(batch.get("image"))  # once per image (no pixels: CIDEr-D)
        scored = self.score(drawn["ids"], references, tf.repeat(tf.range(n), s), images)
        reward = scored["reward"]
        out = {"ids": drawn["ids"], "reward": reward, "log_prob": log_prob, "ended": drawn["ended"]}
        if "clip_s" in scored:
            out["clip_s"] = scored["clip_s"]
        if self.cfg.baseline == "mean":  # the other samples of the same image
            per_image = tf.reshape(reward, [n, s])
            baseline = (tf.reduce_sum(per_image, axis=1, keepdims=True) - per_image) / (s - 1)
            out["baseline"] = tf.reshape(baseline, [-1])
        else:  # the greedy caption's reward, per image, scored as a sample of the same words would be
            out["greedy"] = greedy_captions(model, state, self.cfg.max_length)
            out["baseline"] = tf.repeat(self.score(out["greedy"], references, tf.range(n), images)["reward"], s)
        return out

    def replica_loss(self, model, batch, training):
        drawn = self.rewards(model, batch, training)
        reward, baseline = drawn["reward"], drawn["baseline"]
        advantage = tf.stop_gradient(reward - baseline)
        loss_sum = -tf.reduce_sum(advantage * drawn["log_prob"])
        samples = tf.cast(tf.shape(reward)[0], tf.float32)
        sums = {"reward": tf.reduce_sum(reward), "baseline": tf.reduce_sum(baseline),
                "ended": tf.reduce_sum(tf.cast(drawn["ended"], tf.float32))}
        if "clip_s" in drawn:
            sums["clip_s"] = tf.reduce_sum(drawn["clip_s"])
        if self.cfg.xe_weight > 0:  # + w × the references' cross-entropy per real token (the module docstring)
            sums["xe"] = self.cross_entropy_term(model, batch, training, samples)
            loss_sum = loss_sum + self.cfg.xe_weight * sums["xe"]
        return ReplicaLoss(loss_sum, samples, sums)

    def cross_entropy_term(self, model, batch, training, samples):
        """The replica's references' cross-entropy sum times the global batch's samples over its real tokens:
        divided by the global samples, as the step divides every loss sum, it is the global mean per token."""
        ce = caption_loss_sum(model, batch, training=training, split_padding=self.split_padding)
        counts = tf.stack([samples, tf.cast(tf.reduce_sum(batch["mask"]), tf.float32)])
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            counts = ctx.all_reduce(tf.distribute.ReduceOp.SUM, counts)
        return ce * counts[0] / tf.maximum(counts[1], 1.0)
