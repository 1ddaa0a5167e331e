"""Turning a trained model's step function into captions: batched beam search (greedy is beam size 1).

It runs for a whole batch of images at once inside TensorFlow (wrap them in ``tf.function``), calling
the decoder's ``step`` (:class:`captioning.model.CaptionModel`) once per word for all beams of all images
together. The decoder's state is any nest of batch-major tensors: every tensor of it is repeated per beam
and reordered with the beams, so any decoder works unchanged. im2txt ran its beam search in Python, one
session call per step and one image at a time (~0.3 s per image).

Beam search, as im2txt defined it (so that a beam of 1 is exactly greedy decoding):

* each live caption is extended only by its ``beam_size`` most likely next words (im2txt's later code
  expanded almost the whole vocabulary by mistake); ``<pad>`` and ``<start>`` are never proposed;
* an extension by ``<end>`` completes the caption; the ``beam_size`` best other extensions stay live;
* live captions that reach ``max_length`` words without ``<end>`` are complete at that length;
* complete captions are ranked by ``log_prob / penalty(length)`` (``length`` counts the ``<end>`` token):
  ``length_penalty`` ``avg`` (the default) divides by ``length ** α``, ``gnmt`` by Wu et al.'s
  ``((5 + length) / 6) ** α``, ``none`` by 1; α is ``length_normalization`` (0, the default, ranks by the
  summed log-probability itself under any form);
* ``<unk>`` is never proposed either.

Options that shape the captions inside the search (all off by default; a beam of 1 with all of them off is
exactly greedy decoding):

* ``block_ngrams`` n ≥ 1: no word follows itself, and (n ≥ 2) no n-gram occurs twice in a caption — an
  extension that would repeat one is never proposed (Hugging Face's ``no_repeat_ngram_size``, applied
  inside the beam; self-critical.pytorch blocks trigrams in greedy and sampled decoding only);
* ``bad_endings`` (word ids): a caption whose last word is one of them may not end there — ``<end>`` is
  not proposed after it (self-critical.pytorch's ``remove_bad_endings``; a caption reaching
  ``max_length`` words still ends where it is).

Worked example (beam 2): if after "a" the model gives ``red`` -0.2, ``<end>`` -1.9, ``big`` -2.3, the
live captions become "a red" and "a big" (``<end>`` is not among this caption's top 2 words, so "a" does
not complete here).
"""

from __future__ import annotations

import tensorflow as tf

from captioning.model.word_rules import DEAD as _DEAD
from captioning.model.word_rules import bad_ending_ids, blocked_words, end_banned
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID



def length_penalty(length, form: str, alpha: float):
    """What a caption's summed log-probability is divided by, at ``length`` (words and ``<end>``).

    >>> [round(float(length_penalty(tf.constant(7.0), f, 1.0)), 3) for f in ("none", "avg", "gnmt")]
    [1.0, 7.0, 2.0]
    """
    if form == "none" or not alpha:
        return tf.ones_like(length)
    if form == "avg":
        return length ** alpha
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    raise ValueError(f"length_penalty must be none, avg or gnmt, got {form!r}")


def _merge(best, candidates, n: int):
    """Keeps the ``n`` best of two sets of complete captions (dicts of [B, M, ...] tensors) by their ``scores``;
    a placeholder (``log_probs`` at the dead score) ranks below every real caption, whatever its score."""
    joined = {k: tf.concat([best[k], candidates[k]], axis=1) for k in best}
    key = tf.where(joined["log_probs"] > _DEAD / 2, joined["scores"], -float("inf"))
    _, index = tf.math.top_k(key, k=n)
    return {k: tf.gather(v, index, batch_dims=1) for k, v in joined.items()}


def beam_search(model, features, beam_size: int = 3, max_length: int = 20, length_normalization: float = 0.0,
                top_k: int = 1, initial_state=None, length_penalty_form: str = "avg", block_ngrams: int = 0,
                bad_endings=(), beam_groups: int = 1, diversity: float = 0.0, min_length: int = 0) -> dict:
    """Captions for a batch of encoder ``features`` ``[B, D]`` (or from the decoder's ``initial_state``
    for them, when given; ``features`` is then unused).

    Returns ``{"ids": int32 [B, top_k, max_length] (words only, 0-padded), "lengths": int32 [B, top_k]
    (words), "log_probs": float32 [B, top_k] (summed log-probabilities of the words and of <end> when the
    caption completed), "scores": float32 [B, top_k] (the ranking score)}``, best first. A decoder that
    ``attends`` (its state a dict whose ``attention`` entry holds the weights of the step just taken,
    ``[B, G]``) also gets ``"attention": float32 [B, top_k, max_length, G]``: for each word of each caption, the weights
    it was chosen with (kept per beam and reordered with the beams; zeros after the caption's end). A slot
    with no caption (fewer complete captions than ``top_k``) comes last, empty, with log p -1e9.

    ``min_length``: ``<end>`` is not proposed before that many words (Hugging Face's ``min_length``; im2txt
    never let a caption end at its first step): :func:`generate` asks for 1, so a caption is never empty.

    **Diverse beam search** (Vijayakumar et al. 2018, Algorithm 1, as fairseq, Hugging Face and
    self-critical.pytorch run it): ``beam_groups`` G divides the beam into G groups of ``beam_size / G``
    beams, each a beam search of its own, one live caption each at first. At every step the groups choose in
    turn, and a word's log-probability is lowered by ``diversity`` λ times the number of captions of the
    earlier groups that chose it at this step (Hamming diversity; a caption an earlier group completed at
    this step chose ``<end>``). That penalised score is what a group's captions carry forward and are ranked
    by (``scores``); ``log_probs`` stay the model's own. Each group keeps its own complete captions, and the
    ``top_k`` returned come one per group in turn: the groups' best captions first, then their second ones, and
    so on, each round likeliest first by the model's own log-probability (length penalty applied, as one beam
    search ranks its captions; the penalised scores would favour the first group). So ``top_k`` <= G captions
    come from ``top_k`` groups, the first being the likeliest of the groups' best. One group is plain beam
    search.
    """
    if not 1 <= top_k <= beam_size:
        raise ValueError(f"top_k must be between 1 and beam_size ({beam_size}), got {top_k}")
    if beam_groups < 1 or beam_size % beam_groups:
        raise ValueError(f"beam_groups ({beam_groups}) must divide beam_size ({beam_size})")
    k, n, steps, groups = beam_size, top_k, max_length, beam_groups
    per = k // groups  # beams per group
    keep = min(per, n)  # complete captions each group keeps
    if initial_state is None:
        initial_state = model.initial_state(features, training=False)
    initial_state = model.reserve(initial_state, steps)  # room for the words' cached keys and values
    batch = tf.shape(tf.nest.flatten(initial_state)[0])[0]
    vocab = model.vocab_size
    kw = min(per, vocab)  # words proposed per live caption
    # every state tensor [B*K, ...]: image-major, beam-minor (groups in order)
    state = tf.nest.map_structure(lambda s: tf.repeat(s, k, axis=0), initial_state)
    state_shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
    tokens = tf.fill([batch * k], tf.constant(START_ID, tf.int32))
    alive_logp = tf.tile(tf.constant([([0.0] + [_DEAD] * (per - 1)) * groups]), [batch, 1])  # one live beam a group
    alive_score = alive_logp  # the penalised log p of diverse beams (the log p itself otherwise)
    alive_ids = tf.zeros([batch, k, steps], tf.int32)
    # each group's complete captions, group after group: [B, groups * keep, ...]
    done = {"ids": tf.zeros([batch, groups * keep, steps], tf.int32), "lengths": tf.zeros([batch, groups * keep], tf.int32),
            "log_probs": tf.fill([batch, groups * keep], _DEAD), "scores": tf.fill([batch, groups * keep], _DEAD)}
    never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID, UNK_ID], vocab), axis=0) * _DEAD  # words never proposed
    shaping = block_ngrams or bad_endings
    diverse = groups > 1 and bool(diversity)
    rows = tf.range(batch)[:, None] * k
    attends = model.attends
    if attends:  # the weights behind each word of each live caption
        cells = tf.shape(state["attention"])[1]
        alive_attention = tf.zeros([batch, k, steps, cells])
        done["attention"] = tf.zeros([batch, groups * keep, steps, cells])
    else:
        alive_attention = tf.zeros([0])

    for t in tf.range(steps):
        # with the attention weights' cells as the step gives them (a grid whose size a trace leaves open)
        tf.autograph.experimental.set_loop_options(shape_invariants=list(
            zip(tf.nest.flatten(state), tf.nest.flatten(state_shapes))) + ([
                (alive_attention, tf.TensorShape([None, k, steps, None])),
                (done["attention"], tf.TensorShape([None, groups * keep, steps, None]))] if attends else []))
        logits, state = model.step(tokens, state)
        if attends:  # word t of every live caption is chosen with this step's weights
            weights = tf.reshape(tf.cast(state["attention"], tf.float32), [batch, k, 1, cells])
            alive_attention = alive_attention + weights * tf.one_hot(t, steps)[None, None, :, None]
        logp = tf.nn.log_softmax(tf.cast(logits, tf.float32)) + never
        if min_length:
            logp += end_banned(vocab, t, min_length)
        logp = tf.reshape(logp, [batch, k, vocab])
        if shaping:
            logp += blocked_words(alive_ids, t, vocab, block_ngrams, bad_endings) * _DEAD
        length = tf.cast(t + 1, tf.float32)  # t words + <end>
        # how many captions of earlier groups chose each word now, <end> included (diverse beams only)
        chosen = tf.zeros([batch, vocab]) if diverse else None
        new_logp, new_score, parents, new_words, kept = [], [], [], [], []
        for g in range(groups):
            mine = slice(g * per, (g + 1) * per)
            group_logp, group_alive, group_score = logp[:, mine], alive_logp[:, mine], alive_score[:, mine]
            ranked = group_logp - diversity * chosen[:, None, :] if diverse else group_logp
            _, top_words = tf.math.top_k(ranked, k=kw)  # [B, per, kw]
            true = group_alive[:, :, None] + tf.gather(group_logp, top_words, batch_dims=2)
            total = group_score[:, :, None] + tf.gather(ranked, top_words, batch_dims=2)  # carried forward
            valid = (group_alive[:, :, None] > _DEAD / 2) & (true > _DEAD / 2)
            is_end = tf.equal(top_words, END_ID)
            # complete captions: live beams whose top words include <end> (one <end> a beam)
            ends = is_end & valid
            end_logp = tf.reduce_max(tf.where(ends, true, _DEAD), axis=2)
            end_score = tf.reduce_max(tf.where(ends, total, _DEAD), axis=2)
            completed = tf.reduce_any(ends, axis=2)
            finished = {"ids": alive_ids[:, mine], "lengths": tf.fill([batch, per], t), "log_probs": end_logp,
                        "scores": tf.where(completed, end_score / length_penalty(
                            length, length_penalty_form, length_normalization), _DEAD)}
            if attends:  # its t words, without the weights <end> was chosen with
                finished["attention"] = (alive_attention[:, mine]
                                         * tf.cast(tf.range(steps) < t, tf.float32)[None, None, :, None])
            mine_done = {key: value[:, g * keep:(g + 1) * keep] for key, value in done.items()}
            kept.append(_merge(mine_done, finished, keep))
            # live captions: the group's best extensions by a word other than <end>, by the carried score
            going = tf.reshape(valid & ~is_end, [batch, per * kw])
            _, index = tf.math.top_k(tf.where(going, tf.reshape(total, [batch, per * kw]), -float("inf")), k=per)
            picked = tf.gather(going, index, batch_dims=1)
            group_new = tf.where(picked, tf.gather(tf.reshape(true, [batch, per * kw]), index, batch_dims=1), _DEAD)
            group_total = tf.where(picked, tf.gather(tf.reshape(total, [batch, per * kw]), index, batch_dims=1), _DEAD)
            words = tf.gather(tf.reshape(top_words, [batch, per * kw]), index, batch_dims=1)
            if diverse:
                chosen += tf.reduce_sum(tf.one_hot(words, vocab) * tf.cast(picked, tf.float32)[:, :, None], axis=1)
                chosen += tf.one_hot(END_ID, vocab) * tf.reduce_sum(tf.cast(completed, tf.float32), axis=1)[:, None]
            new_logp.append(group_new)
            new_score.append(group_total)
            parents.append(index // kw + g * per)
            new_words.append(words)
        done = {key: tf.concat([part[key] for part in kept], axis=1) for key in done}
        alive_logp = tf.concat(new_logp, axis=1)
        alive_score = tf.concat(new_score, axis=1)
        parent = tf.concat(parents, axis=1)
        words = tf.concat(new_words, axis=1)
        alive_ids = tf.gather(alive_ids, parent, batch_dims=1)
        alive_ids = alive_ids + words[:, :, None] * tf.one_hot(t, steps, dtype=tf.int32)[None, None, :]
        if attends:
            alive_attention = tf.gather(alive_attention, parent, batch_dims=1)
        state = tf.nest.map_structure(lambda s: tf.gather(s, tf.reshape(rows + parent, [-1])), state)
        tokens = tf.reshape(words, [-1])

    # live captions that reached max_length words complete there; each group keeps its best
    penalty = length_penalty(tf.constant(float(steps)), length_penalty_form, length_normalization)
    truncated = {"ids": alive_ids, "lengths": tf.fill([batch, k], steps), "log_probs": alive_logp,
                 "scores": tf.where(alive_logp > _DEAD / 2, alive_score / penalty, _DEAD)}
    if attends:
        truncated["attention"] = alive_attention
    final = [_merge({key: value[:, g * keep:(g + 1) * keep] for key, value in done.items()},
                    {key: value[:, g * per:(g + 1) * per] for key, value in truncated.items()}, keep)
             for g in range(groups)]
    if groups == 1:
        return final[0]
    # one per group in turn (the groups' best, then their second, ...), each round by the model's log p
    turns = {key: tf.stack([part[key] for part in final], axis=2) for key in final[0]}  # [B, keep, groups, ...]
    counted = tf.cast(tf.where(turns["lengths"] < steps, turns["lengths"] + 1, turns["lengths"]), tf.float32)
    likely = tf.where(turns["log_probs"] > _DEAD / 2, turns["log_probs"] / length_penalty(
        counted, length_penalty_form, length_normalization), -float("inf"))
    within = tf.argsort(likely, axis=2, direction="DESCENDING", stable=True)
    turns = {key: tf.gather(value, within, batch_dims=2) for key, value in turns.items()}
    turns = {key: tf.reshape(value, tf.concat([[batch, keep * groups], tf.shape(value)[3:]], 0))
             for key, value in turns.items()}
    order = tf.argsort(tf.cast(turns["log_probs"] <= _DEAD / 2, tf.int32), axis=1, stable=True)[:, :n]
    return {key: tf.gather(value, order, batch_dims=1) for key, value in turns.items()}


def ids_to_text(vocab, ids, lengths) -> list[list[str]]:
    """Captions as strings from :func:`beam_search`'s ``ids`` and ``lengths`` (numpy or tensors)."""
    ids, lengths = getattr(ids, "numpy", lambda: ids)(), getattr(lengths, "numpy", lambda: lengths)()
    return [[" ".join(vocab.words[w] for w in row[:length]) for row, length in zip(image_ids, image_lengths)]
            for image_ids, image_lengths in zip(ids, lengths)]


def empty_captions_warning(best) -> str | None:
    """One line saying how many of the best captions ``best`` (strings, one per image) are empty, or None.
    :func:`generate` gives every caption a word; an empty one means something else went wrong, and is never
    silent (``caption`` and ``evaluate`` print this).

    >>> empty_captions_warning(["a red circle", "", " "])
    '2 of 3 best captions are empty (the model ended them before any word): their images are described by nothing'
    """
    best = list(best)
    empty = sum(1 for text in best if not text.strip())
    if not empty:
        return None
    return (f"{empty} of {len(best)} best captions are empty (the model ended them before any word): their images "
            "are described by nothing")


def generate(model, initial_state, settings, bad_endings=(), keys=None) -> dict:
    """Captions from the decoder's initial state as ``settings`` (a :class:`captioning.config.DecodeConfig`)
    say: beam search, greedy decoding (a beam of 1) or sampling, in :func:`beam_search`'s output format.
    ``bad_endings``: word ids (:func:`captioning.model.word_rules.bad_ending_ids`); ``keys [B]``: the images' sampling keys. Every caption
    has at least one word (``<end>`` is never the first: ``min_length`` 1), whichever the method."""
    common = {"max_length": settings.max_length, "block_ngrams": settings.block_ngrams, "bad_endings": bad_endings,
              "min_length": 1}
    if settings.method == "sample":
        from captioning.model.sampling import sample_search

        return sample_search(model, initial_state, samples=settings.top_k, temperature=settings.temperature,
                             sample_top_k=settings.sample_top_k, sample_top_p=settings.sample_top_p,
                             seed=settings.seed, keys=keys, **common)
    beam = 1 if settings.method == "greedy" else settings.beam_size
    return beam_search(model, None, beam_size=beam, top_k=1 if settings.method == "greedy" else settings.top_k,
                       length_normalization=settings.length_normalization, initial_state=initial_state,
                       length_penalty_form=settings.length_penalty, beam_groups=settings.beam_groups if beam > 1 else 1,
                       diversity=settings.diversity, **common)
