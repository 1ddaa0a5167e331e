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

from captioning.model.search_tools import best_of, log_normalizer, never_proposed, one_loop, search_over, traced_back
from captioning.model.word_rules import DEAD as _DEAD, bad_ending_ids, blocked_words
from captioning.vocab import END_ID, RESERVED, START_ID


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


def beam_search(model, features, beam_size: int = 3, max_length: int = 20, length_normalization: float = 0.0,
                top_k: int = 1, initial_state=None, length_penalty_form: str = "avg", block_ngrams: int = 0,
                bad_endings=(), beam_groups: int = 1, diversity: float = 0.0, min_length: int = 0,
                fast_greedy: bool = True) -> dict:
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
    come from ``top_k`` groups, the first being the likeliest of the groups' best. One group is beam search.

    A beam of 1 runs :func:`_greedy`, a loop of a few ops a step that gives exactly what the beam search of one
    beam gives (``fast_greedy=False`` runs the beam search itself: tests compare the two). Either search stops
    before ``max_length`` steps once no step can change its result: every caption ended (a beam of 1), or, when
    no length penalty divides the scores, every group holds ``top_k`` complete captions scoring at least as well
    as its best live one (scores only fall as a caption grows).
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
    if k == 1 and fast_greedy:
        return _greedy(model, initial_state, steps, length_penalty_form, length_normalization, block_ngrams,
                       bad_endings, min_length)
    # every state tensor [B*K, ...]: image-major, beam-minor (groups in order)
    state = tf.nest.map_structure(lambda s: tf.repeat(s, k, axis=0), initial_state)
    tokens = tf.fill([batch * k], tf.constant(START_ID, tf.int32))
    alive_logp = tf.tile(tf.constant([([0.0] + [_DEAD] * (per - 1)) * groups]), [batch, 1])  # one live beam a group
    alive_score = alive_logp  # the penalised log p of diverse beams (the log p itself otherwise)
    # the words only where n-gram blocking reads them; the captions themselves are traced back at the end
    track_ids = block_ngrams >= 1
    alive_ids = tf.zeros([batch, k, steps if track_ids else 0], tf.int32)
    never = never_proposed(vocab, min_length)  # words never proposed (row 1: and <end>, before min_length words)
    diverse = groups > 1 and bool(diversity)
    unpenalised = length_penalty_form == "none" or not length_normalization
    plain = unpenalised and not diverse  # a caption's score is its log p
    # scores only fall as captions grow when no length penalty divides them (and diversity only lowers them): then
    # a search whose every group holds `keep` complete captions scoring at least its best live one is over (the
    # ranking puts the earlier caption first on a tie)
    falling = unpenalised and diversity >= 0
    rows = tf.range(batch)[:, None] * k
    attends = model.attends
    cells = tf.shape(state["attention"])[1] if attends else None

    def step(t, state, tokens, alive_logp, alive_score, alive_ids, bias):
        """Every live caption one word on: the new state, tokens, live log p and scores (a dead caption's are at
        most the dead score / 2) and words so far, and what the step chose: each new live caption's word and parent,
        each old live caption's log p and score of ending here (dead: it could not) and its attention weights."""
        logits, state = model.step(tokens, state)
        logits = tf.cast(logits, tf.float32)
        rules = bias  # the dead score on the words ruled out
        if track_ids:
            rules += tf.reshape(blocked_words(alive_ids, t, vocab, block_ngrams, bad_endings), [-1, vocab]) * _DEAD
        elif bad_endings:  # only the last word matters
            rules += blocked_words(tokens[:, None], tf.minimum(t, 1), vocab, 0, bad_endings) * _DEAD
        # each beam's words ranked by their logits (the next step waits for this choice) and their log p: the logit less
        # the row's log-sum-exp, from the softmax that runs beside it (search_tools.log_normalizer)
        if diverse:  # a group's choice depends on the earlier groups' words
            logp = tf.reshape(tf.nn.log_softmax(logits) + rules, [batch, k, vocab])
        else:
            if track_ids or bad_endings:  # (a word ruled out may be the likeliest: log_normalizer cannot tell)
                ranked = best_of(logits + rules, kw)  # [B*K, kw]
                ranked_logp = tf.gather(tf.nn.log_softmax(logits) + rules, ranked, batch_dims=1)
            else:  # the rules: the words never proposed, the vocabulary's first
                ranked = best_of(logits, kw, head=rules[:len(RESERVED)])
                ranked_logp = tf.gather(logits, ranked, batch_dims=1) - log_normalizer(logits, ranked[:, 0])[
                    :, None] + tf.gather(rules, ranked)
            ranked, ranked_logp = tf.reshape(ranked, [batch, k, kw]), tf.reshape(ranked_logp, [batch, k, kw])
        penalty = 1.0 if plain else length_penalty(tf.cast(t + 1, tf.float32), length_penalty_form,
                                                   length_normalization)  # t words + <end>
        # how many captions of earlier groups chose each word now, <end> included (diverse beams only)
        chosen = tf.zeros([batch, vocab]) if diverse else None
        new_logp, new_score, parents, new_words, end_logps, end_scores = [], [], [], [], [], []
        for g in range(groups):
            mine = slice(g * per, (g + 1) * per)
            group_alive = alive_logp if groups == 1 else alive_logp[:, mine]
            if diverse:
                group_logp = logp[:, mine]
                top, top_words = tf.math.top_k(group_logp - diversity * chosen[:, None, :], k=kw)  # [B, per, kw]
                true = group_alive[:, :, None] + tf.gather(group_logp, top_words, batch_dims=2)
                total = alive_score[:, mine][:, :, None] + top  # carried forward
            else:  # the score is the log p itself
                top_words = ranked if groups == 1 else ranked[:, mine]
                true = total = group_alive[:, :, None] + (ranked_logp if groups == 1 else ranked_logp[:, mine])
            # (a dead caption's extensions, and a word ruled out, are at most the dead score / 2: log p <= 0)
            is_end = tf.equal(top_words, END_ID)
            # complete captions: live beams whose top words include <end> (one <end> a beam)
            end_logp = tf.reduce_max(tf.where(is_end, true, _DEAD), axis=2)
            end_logps.append(end_logp)
            if plain:
                end_scores.append(end_logp)
            else:
                end_score = tf.reduce_max(tf.where(is_end & (true > _DEAD / 2), total, _DEAD), axis=2)
                end_scores.append(tf.where(end_logp > _DEAD / 2, end_score / penalty, _DEAD))
            # live captions: the group's best extensions by a word other than <end>, by the carried score
            extensions = tf.reshape(tf.where(is_end, 2 * _DEAD, total), [batch, per * kw])
            if per * kw == 1:  # one live caption, one word: nothing to choose between
                values, index = extensions, tf.zeros([batch, 1], tf.int32)
                words = tf.reshape(top_words, [batch, 1])
            else:
                values, index = tf.math.top_k(extensions, k=per)
                words = tf.gather(tf.reshape(top_words, [batch, per * kw]), index, batch_dims=1)
            if diverse:
                picked = values > _DEAD / 2
                new_logp.append(tf.where(picked, tf.gather(tf.reshape(true, [batch, per * kw]), index, batch_dims=1),
                                         _DEAD))
                new_score.append(tf.where(picked, values, _DEAD))
                chosen += tf.reduce_sum(tf.one_hot(words, vocab) * tf.cast(picked, tf.float32)[:, :, None], axis=1)
                chosen += tf.one_hot(END_ID, vocab) * tf.reduce_sum(
                    tf.cast(end_logp > _DEAD / 2, tf.float32), axis=1)[:, None]
            else:
                new_logp.append(values)
            parents.append(index // kw + g * per if k > 1 else index)
            new_words.append(words)

        def joined(parts):
            return parts[0] if groups == 1 else tf.concat(parts, axis=1)

        alive_logp = joined(new_logp)
        alive_score = joined(new_score) if diverse else alive_logp
        parent, words = joined(parents), joined(new_words)
        weights = None
        if attends:  # word t of every live caption was chosen with its parent's weights of this step
            weights = tf.reshape(tf.cast(state["attention"], tf.float32), [batch, k, cells])
            weights = tf.gather(weights, parent, batch_dims=1) if k > 1 else weights
        if track_ids:
            alive_ids = tf.gather(alive_ids, parent, batch_dims=1)
            alive_ids = alive_ids + words[:, :, None] * tf.one_hot(t, steps, dtype=tf.int32)[None, None, :]
        if k > 1:  # (one beam: its own parent)
            state = tf.nest.map_structure(lambda s: tf.gather(s, tf.reshape(rows + parent, [-1])), state)
        return (state, tf.reshape(words, [-1]), alive_logp, alive_score, alive_ids, words, parent,
                joined(end_logps), joined(end_scores), weights)

    # what each step chose is kept, per live caption after it: its word and the live caption it extends (its
    # parent); and per live caption before it, the log p and ranking score of ending it there (dead: <end> was not
    # among its words): [B, K, steps so far], grown a step at a time. A complete caption is its step and its live
    # caption: its words are traced back through the parents at the end, and the complete captions are ranked once,
    # at the end. (One loop for every step: a first step apart would copy the decoder's step, and its weights into
    # a LiteRT file twice. The test in the loop's condition, not a `break`: a break puts the step inside a conditional,
    # and a LiteRT file then carries the decoder's weights as unquantized operands of it.) A step reads the test of the
    # step before last, as in _greedy. best_done: each group's `keep` best complete scores so far.
    grown = tf.zeros([batch, k, 0])
    loop = {"t": tf.constant(0), "over": tf.constant(False), "over_before": tf.constant(False), "state": state,
            "tokens": tokens, "alive_logp": alive_logp, "alive_score": alive_score, "alive_ids": alive_ids,
            "best_done": tf.fill([batch, groups, keep], _DEAD), "words": tf.cast(grown, tf.int32),
            "parents": tf.cast(grown, tf.int32), "ends_logp": grown, "ends_score": grown,
            "weights": tf.zeros([batch, k, 0, cells]) if attends else tf.zeros([0])}
    growing = {key: tf.TensorShape([None, k, None]) for key in ("words", "parents", "ends_logp", "ends_score")}
    growing["weights"] = tf.TensorShape([None, k, None, None] if attends else [0])

    def one_step(v):
        bias = never[tf.cast(v["t"] < min_length, tf.int32)] if min_length else never[0]
        (state, tokens, alive_logp, alive_score, alive_ids, words, parent, end_logp, end_score,
         weights) = step(v["t"], v["state"], v["tokens"], v["alive_logp"], v["alive_score"], v["alive_ids"], bias)
        over, best_done = search_over(alive_logp, alive_score, end_logp, end_score, v["best_done"], k, groups, falling)
        return {"t": v["t"] + 1, "over": over, "over_before": v["over"], "state": state, "tokens": tokens,
                "alive_logp": alive_logp, "alive_score": alive_score, "alive_ids": alive_ids, "best_done": best_done,
                "words": tf.concat([v["words"], words[:, :, None]], axis=2),
                "parents": tf.concat([v["parents"], parent[:, :, None]], axis=2),
                "ends_logp": tf.concat([v["ends_logp"], end_logp[:, :, None]], axis=2),
                "ends_score": v["ends_score"] if plain else tf.concat([v["ends_score"], end_score[:, :, None]], 2),
                "weights": tf.concat([v["weights"], weights[:, :, None]], axis=2) if attends else v["weights"]}

    loop = one_loop(lambda v: (v["t"] < steps) & tf.logical_not(v["over_before"]), one_step, loop, growing)
    ran, alive_logp, alive_score, words_so_far, parents_so_far, ends_logp, weights_so_far = (
        loop[key] for key in ("t", "alive_logp", "alive_score", "words", "parents", "ends_logp", "weights"))
    ends_score = ends_logp if plain else loop["ends_score"]

    # each group's best complete captions, ranked once among every step's, and the live captions, which complete
    # where they are (at max_length words, or where a search that is over stopped: they rank below its complete ones)
    last = length_penalty(tf.cast(ran, tf.float32), length_penalty_form, length_normalization)
    final = []
    for g in range(groups):
        mine = slice(g * per, (g + 1) * per)
        # candidates step after step, live captions last: index i < ran * per is step i // per, beam i % per
        logps = tf.concat([tf.reshape(tf.transpose(ends_logp[:, mine], [0, 2, 1]), [batch, -1]), alive_logp[:, mine]], 1)
        scores = tf.concat([tf.reshape(tf.transpose(ends_score[:, mine], [0, 2, 1]), [batch, -1]),
                            tf.where(alive_logp[:, mine] > _DEAD / 2, alive_score[:, mine] / last, _DEAD)], 1)
        _, index = tf.math.top_k(tf.where(logps > _DEAD / 2, scores, -float("inf")), k=keep)
        real = tf.gather(logps, index, batch_dims=1) > _DEAD / 2  # else an empty slot: no words, dead scores
        live = index >= ran * per
        final.append({"beam": tf.where(real, g * per + tf.where(live, index - ran * per, index % per), 0),
                      "lengths": tf.where(real, tf.where(live, ran, index // per), 0),
                      "log_probs": tf.where(real, tf.gather(logps, index, batch_dims=1), _DEAD),
                      "scores": tf.where(real, tf.gather(scores, index, batch_dims=1), _DEAD)})
    if k == 1:  # one beam: every parent is beam 0
        parents_so_far = tf.zeros_like(words_so_far)
    if groups == 1:
        return traced_back(final[0], words_so_far, parents_so_far, weights_so_far if attends else None, steps)
    # one per group in turn (the groups' best, then their second, ...), each round by the model's log p
    turns = {key: tf.stack([part[key] for part in final], axis=2) for key in final[0]}  # [B, keep, groups]
    counted = tf.cast(tf.where(turns["lengths"] < steps, turns["lengths"] + 1, turns["lengths"]), tf.float32)
    likely = tf.where(turns["log_probs"] > _DEAD / 2, turns["log_probs"] / length_penalty(
        counted, length_penalty_form, length_normalization), -float("inf"))
    within = tf.argsort(likely, axis=2, direction="DESCENDING", stable=True)
    turns = {key: tf.reshape(tf.gather(value, within, batch_dims=2), [batch, keep * groups])
             for key, value in turns.items()}
    order = tf.argsort(tf.cast(turns["log_probs"] <= _DEAD / 2, tf.int32), axis=1, stable=True)[:, :n]
    best = {key: tf.gather(value, order, batch_dims=1) for key, value in turns.items()}
    return traced_back(best, words_so_far, parents_so_far, weights_so_far if attends else None, steps)


def _greedy(model, state, steps: int, length_penalty_form: str, length_normalization: float, block_ngrams: int,
            bad_endings, min_length: int) -> dict:
    """A beam of one (:func:`beam_search`'s output, ``top_k`` 1): each step's likeliest word, ``<end>`` completing
    the caption; a few ops a step beside the decoder's own, and no step after every caption ended. A caption's
    length is how many words it kept (a word is never ``<pad>``: id 0)."""
    batch, vocab = tf.shape(tf.nest.flatten(state)[0])[0], model.vocab_size
    never = never_proposed(vocab, min_length)
    track_ids = block_ngrams >= 1
    attends = model.attends

    def step(t, state, tokens, live, log_probs, ids, bias):
        """One word more for every caption: ``live [B, 1]`` says which had not ended; returns the state, the tokens
        fed next, which are still live, the log p so far, the words for blocking, and what the step kept: each
        caption's word (0 once it ended) and the weights it was chosen with (zeros once it ended)."""
        logits, state = model.step(tokens, state)
        logits = tf.cast(logits, tf.float32)
        # the likeliest word allowed (the first of equal ones): the next step waits only for it, the softmax runs beside
        if track_ids or bad_endings:
            rules = blocked_words(ids, t, vocab, block_ngrams, bad_endings) if track_ids else blocked_words(
                tokens[:, None], tf.minimum(t, 1), vocab, 0, bad_endings)  # (bad endings: only the last word matters)
            word = tf.argmax(logits + bias + rules * _DEAD, axis=1, output_type=tf.int32)[:, None]  # [B, 1]
            word_logp = tf.gather(tf.nn.log_softmax(logits), word, batch_dims=1)
        else:  # the likeliest of all words, or where it is never proposed (rare), of the others: no sum over them all
            likeliest = tf.argmax(logits, axis=1, output_type=tf.int32)
            word = tf.cond(tf.reduce_any(tf.gather(bias, likeliest) < 0.0),
                           lambda: tf.argmax(logits + bias, axis=1, output_type=tf.int32), lambda: likeliest)[:, None]
            word_logp = tf.gather(logits, word, batch_dims=1) - log_normalizer(logits, likeliest, of_all=True)[:, None]
        log_probs += tf.where(live, word_logp, 0.0)  # <end>'s too
        live = live & tf.not_equal(word, END_ID)
        kept = tf.where(live, word, 0)
        if track_ids:
            ids += kept * tf.one_hot(t, steps, dtype=tf.int32)[None, :]
        weights = tf.where(live, tf.cast(state["attention"], tf.float32), 0.0) if attends else None
        return state, tf.reshape(word, [-1]), live, log_probs, ids, kept, weights

    # a step's test for the end reads the captions of the step before last, so the next step need not wait for it: at
    # most one step runs after every caption ended (it keeps no word, adds no log p). The words so far only for n-gram
    # blocking; the words, and the weights, kept grow a step at a time. (The test in the condition: see beam_search.)
    loop = {"t": tf.constant(0), "ended": tf.constant(False), "ended_before": tf.constant(False), "state": state,
            "tokens": tf.fill([batch], tf.constant(START_ID, tf.int32)), "live": tf.ones([batch, 1], tf.bool),
            "log_probs": tf.zeros([batch, 1]), "ids": tf.zeros([batch, steps if track_ids else 0], tf.int32),
            "words": tf.zeros([batch, 0], tf.int32),
            "weights": tf.zeros([batch, 0, tf.shape(state["attention"])[1]]) if attends else tf.zeros([0])}
    growing = {"words": tf.TensorShape([None, None]), "weights": tf.TensorShape([None, None, None] if attends else [0])}

    def one_step(v):
        bias = never[tf.cast(v["t"] < min_length, tf.int32)] if min_length else never[0]
        state, tokens, live, log_probs, ids, kept, weights = step(v["t"], v["state"], v["tokens"], v["live"],
                                                                  v["log_probs"], v["ids"], bias)
        return {"t": v["t"] + 1, "ended": tf.logical_not(tf.reduce_any(live)), "ended_before": v["ended"],
                "state": state, "tokens": tokens, "live": live, "log_probs": log_probs, "ids": ids,
                "words": tf.concat([v["words"], kept], axis=1),
                "weights": tf.concat([v["weights"], weights[:, None]], axis=1) if attends else v["weights"]}

    loop = one_loop(lambda v: (v["t"] < steps) & tf.logical_not(v["ended_before"]), one_step, loop, growing)
    words_so_far, weights_so_far, log_probs = loop["words"], loop["weights"], loop["log_probs"]
    ran = tf.shape(words_so_far)[1]
    lengths = tf.reduce_sum(tf.cast(words_so_far > 0, tf.int32), axis=1, keepdims=True)
    counted = tf.cast(tf.where(lengths < steps, lengths + 1, lengths), tf.float32)  # <end> counts when it came
    out = {"ids": tf.pad(words_so_far, [[0, 0], [0, steps - ran]])[:, None], "lengths": lengths,
           "log_probs": log_probs, "scores": log_probs / length_penalty(counted, length_penalty_form,
                                                                       length_normalization)}
    if attends:
        out["attention"] = tf.pad(weights_so_far, [[0, 0], [0, steps - ran], [0, 0]])[:, None]
    return out


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
    """Captions from the decoder's initial state as ``settings`` (a :class:`captioning.config.DecodeConfig`) say, in
    :func:`beam_search`'s format (greedy: a beam of 1; or sampling); ``bad_endings``: word ids, ``keys [B]``: seeds."""
    search, arguments = search_arguments(settings)
    if search == "sample":
        from captioning.model.sampling import sample_search
        return sample_search(model, initial_state, keys=keys, bad_endings=bad_endings, **arguments)
    return beam_search(model, None, initial_state=initial_state, bad_endings=bad_endings, **arguments)


def search_arguments(settings) -> tuple[str, dict]:
    """The search :func:`generate` runs for ``settings`` and all it reads of them but ``bad_endings``: the same
    arguments, the same captions and graph (``captioning serve`` keys its decoders so: a beam's seed traces nothing)."""
    common = dict(max_length=settings.max_length, block_ngrams=settings.block_ngrams, min_length=1)
    if settings.method == "sample":
        return "sample", dict(samples=settings.top_k, temperature=settings.temperature, seed=settings.seed,
                              sample_top_k=settings.sample_top_k, sample_top_p=settings.sample_top_p, **common)
    beam = 1 if settings.method == "greedy" else settings.beam_size
    return "beam", dict(beam_size=beam, top_k=1 if settings.method == "greedy" else settings.top_k,
                        length_normalization=settings.length_normalization, length_penalty_form=settings.length_penalty,
                        beam_groups=settings.beam_groups if beam > 1 else 1, diversity=settings.diversity, **common)
