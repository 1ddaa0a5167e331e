"""Beam search and diverse beam search: the :class:`BeamSearch` strategy of the one word-by-word loop
(:func:`captioning.model.search_loop.search`), as :mod:`captioning.model.decode` defines them, and the length
penalty that ranks their captions. Each step extends every live caption by its best words and keeps each group's
best extensions; a complete caption is kept as the step it ended at and the live caption it ends in, and its words
and attention weights are traced back once, at the end (:func:`captioning.model.search_tools.traced_back`)."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.search_loop import Strategy
from captioning.model.search_tools import best_of, log_normalizer, never_proposed, search_over, traced_back
from captioning.model.word_rules import DEAD, WordRules, blocked_words
from captioning.vocab import END_ID, RESERVED


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


class BeamSearch(Strategy):
    """``beam_size`` live captions per image in ``beam_groups`` groups (:func:`captioning.model.decode.beam_search`
    says what each option does). Its rows: image-major, beam-minor, the groups in order. Loop variables, ``[B,
    beams]`` a live caption's log p (``alive_logp``) and the score it carries (``alive_score``: the penalised log p of
    diverse beams, the log p otherwise; a dead caption's at most the dead score / 2), its words when n-gram blocking
    reads them (``alive_ids``), each group's best complete scores (``best_done``); and grown a step at a time, what
    each step chose (``[B, beams, steps so far]``): per live caption after it, its word and the live caption it
    extends (``words``, ``parents``), and per live caption before it, the log p and score of ending there
    (``ends_logp``, ``ends_score``; dead: ``<end>`` was not among its words), and the attention weights."""

    def __init__(self, model, beam_size: int, max_length: int, top_k: int = 1, length_normalization: float = 0.0,
                 length_penalty_form: str = "avg", block_ngrams: int = 0, bad_endings=(), beam_groups: int = 1,
                 diversity: float = 0.0, min_length: int = 0, words=None):
        self.check(beam_size, top_k, beam_groups)
        # over a subword tokenizer's words (words: its WordTable), in word_-keyed loop variables
        self.word_rules = WordRules.of(words, model.vocab_size, max_length, block_ngrams, bad_endings)
        if self.word_rules:
            block_ngrams, bad_endings = 0, ()
        self.beams = self.rows_per_image = beam_size
        self.top_k, self.max_length, self.groups, self.diversity = top_k, max_length, beam_groups, diversity
        self.beams_per_group = beam_size // beam_groups
        self.kept_per_group = min(self.beams_per_group, top_k)  # complete captions each group keeps
        self.vocab, self.attends = model.vocab_size, model.attends
        self.words_per_caption = min(self.beams_per_group, self.vocab)  # words proposed per live caption
        self.penalty_form, self.alpha, self.min_length = length_penalty_form, length_normalization, min_length
        self.block_ngrams, self.bad_endings = block_ngrams, tuple(bad_endings)
        self.tracks_ids = block_ngrams >= 1  # the words only where n-gram blocking reads them
        self.diverse = beam_groups > 1 and bool(diversity)
        unpenalised = length_penalty_form == "none" or not length_normalization
        self.score_is_log_prob = unpenalised and not self.diverse
        # scores only fall as captions grow when no length penalty divides them (and diversity only lowers them): then
        # a search whose every group holds its complete captions scoring at least its best live one is over
        self.scores_only_fall = unpenalised and diversity >= 0
        self.growing = {key: tf.TensorShape([None, beam_size, None])
                        for key in ("words", "parents", "ends_logp", "ends_score")}
        self.growing["weights"] = tf.TensorShape([None, beam_size, None, None] if self.attends else [0])

    @staticmethod
    def check(beam_size: int, top_k: int, beam_groups: int):
        """A ValueError unless ``top_k`` is at most ``beam_size`` and ``beam_groups`` divides it."""
        if not 1 <= top_k <= beam_size:
            raise ValueError(f"top_k must be between 1 and beam_size ({beam_size}), got {top_k}")
        if beam_groups < 1 or beam_size % beam_groups:
            raise ValueError(f"beam_groups ({beam_groups}) must divide beam_size ({beam_size})")

    def start(self, batch, state):
        self.batch, beams = batch, self.beams
        self.never = never_proposed(self.vocab, self.min_length)  # row 1: and <end>, before min_length words
        self.row_starts = tf.range(batch)[:, None] * beams
        self.cells = tf.shape(state["attention"])[1] if self.attends else None
        first_live = [0.0] + [DEAD] * (self.beams_per_group - 1)  # one live caption a group
        alive_logp = tf.tile(tf.constant([first_live * self.groups]), [batch, 1])
        grown = tf.zeros([batch, beams, 0])
        words = self.word_rules.start(batch * beams) if self.word_rules else {}
        return {**words, "alive_logp": alive_logp, "alive_score": alive_logp,
                "alive_ids": tf.zeros([batch, beams, self.max_length if self.tracks_ids else 0], tf.int32),
                "best_done": tf.fill([batch, self.groups, self.kept_per_group], DEAD),
                "words": tf.cast(grown, tf.int32), "parents": tf.cast(grown, tf.int32), "ends_logp": grown,
                "ends_score": grown, "weights": tf.zeros([batch, beams, 0, self.cells]) if self.attends else tf.zeros([0])}

    def _ruled_out(self, t, tokens, alive_ids, chosen):
        """``[rows, V]`` the dead score on the words the rules forbid after step ``t`` (the words never proposed,
        ``<end>`` before ``min_length`` words, n-gram blocking, bad endings)."""
        rules = self.never[tf.cast(t < self.min_length, tf.int32)] if self.min_length else self.never[0]
        if self.word_rules:  # rows: image-major, beam-minor, as the flattened [B, beams]
            rules += self.word_rules.ruled_out(chosen)
        if self.tracks_ids:
            blocked = blocked_words(alive_ids, t, self.vocab, self.block_ngrams, self.bad_endings)
            rules += tf.reshape(blocked, [-1, self.vocab]) * DEAD
        elif self.bad_endings:  # only the last word matters
            rules += blocked_words(tokens[:, None], tf.minimum(t, 1), self.vocab, 0, self.bad_endings) * DEAD
        return rules

    def _ranked(self, logits, rules):
        """Each live caption's ``words_per_caption`` best words ``[B, beams, W]`` by their logits (the next step waits
        for this choice) and their log p: the logit less the row's log-sum-exp, from the softmax that runs beside it
        (:func:`captioning.model.search_tools.log_normalizer`). A word ruled out may be the likeliest, which the
        normalizer cannot tell: with n-gram blocking or bad endings the log-softmax itself."""
        shape = [self.batch, self.beams, self.words_per_caption]
        if self.tracks_ids or self.bad_endings or self.word_rules:
            ranked = best_of(logits + rules, self.words_per_caption)
            ranked_logp = tf.gather(tf.nn.log_softmax(logits) + rules, ranked, batch_dims=1)
        else:  # the rules: the words never proposed, the vocabulary's first
            ranked = best_of(logits, self.words_per_caption, head=rules[:len(RESERVED)])
            ranked_logp = tf.gather(logits, ranked, batch_dims=1) - log_normalizer(logits, ranked[:, 0])[
                :, None] + tf.gather(rules, ranked)
        return tf.reshape(ranked, shape), tf.reshape(ranked_logp, shape)

    def _group_extended(self, group, alive, candidates, penalty, chosen_before):
        """Group ``group``'s choice at a step, from its live captions' log p and scores ``alive`` and the ``candidates``
        (diverse: the log p of every word ``[B, beams, V]``; else each caption's ranked words and their log p): a dict
        of its new live captions' log p (and scores, for diverse beams), their words and parents, and each old live
        caption's log p and score of ending here. ``chosen_before [B, V]``: how many captions of the earlier groups
        chose each word now (diverse beams)."""
        size, width = self.beams_per_group, self.words_per_caption
        group_slice = slice(group * size, (group + 1) * size)
        if self.groups == 1:
            group_logp, group_score = alive
        else:
            group_logp, group_score = alive[0][:, group_slice], alive[1][:, group_slice]
        if self.diverse:  # a word's score is lowered by diversity × the earlier groups' captions that chose it
            word_logp = candidates[:, group_slice]
            top, top_words = tf.math.top_k(word_logp - self.diversity * chosen_before[:, None, :], k=width)
            extension_logp = group_logp[:, :, None] + tf.gather(word_logp, top_words, batch_dims=2)
            carried = group_score[:, :, None] + top
        else:  # the score is the log p itself
            ranked, ranked_logp = candidates
            top_words = ranked if self.groups == 1 else ranked[:, group_slice]
            extension_logp = carried = group_logp[:, :, None] + (
                ranked_logp if self.groups == 1 else ranked_logp[:, group_slice])
        # (a dead caption's extensions, and a word ruled out, are at most the dead score / 2: log p <= 0)
        is_end = tf.equal(top_words, END_ID)
        # complete captions: live captions whose top words include <end> (one <end> a caption)
        out = {"end_logp": tf.reduce_max(tf.where(is_end, extension_logp, DEAD), axis=2)}
        if self.score_is_log_prob:
            out["end_score"] = out["end_logp"]
        else:
            end_score = tf.reduce_max(tf.where(is_end & (extension_logp > DEAD / 2), carried, DEAD), axis=2)
            out["end_score"] = tf.where(out["end_logp"] > DEAD / 2, end_score / penalty, DEAD)
        # live captions: the group's best extensions by a word other than <end>, by the carried score
        extensions = tf.reshape(tf.where(is_end, 2 * DEAD, carried), [self.batch, size * width])
        if size * width == 1:  # one live caption, one word: nothing to choose between
            values, index = extensions, tf.zeros([self.batch, 1], tf.int32)
            out["words"] = tf.reshape(top_words, [self.batch, 1])
        else:
            values, index = tf.math.top_k(extensions, k=size)
            out["words"] = tf.gather(tf.reshape(top_words, [self.batch, size * width]), index, batch_dims=1)
        out["parents"] = index // width + group * size if self.beams > 1 else index
        out["logp"] = values
        if self.diverse:
            picked = values > DEAD / 2
            flat_logp = tf.reshape(extension_logp, [self.batch, size * width])
            out["logp"] = tf.where(picked, tf.gather(flat_logp, index, batch_dims=1), DEAD)
            out["score"] = tf.where(picked, values, DEAD)
            out["chosen"] = chosen_before + tf.reduce_sum(
                tf.one_hot(out["words"], self.vocab) * tf.cast(picked, tf.float32)[:, :, None], axis=1
            ) + tf.one_hot(END_ID, self.vocab) * tf.reduce_sum(tf.cast(out["end_logp"] > DEAD / 2, tf.float32),
                                                               axis=1)[:, None]
        return out

    def next_words(self, t, tokens, logits, state, chosen):
        rules = self._ruled_out(t, tokens, chosen["alive_ids"], chosen)
        if self.diverse:  # a group's choice depends on the earlier groups' words
            candidates = tf.reshape(tf.nn.log_softmax(logits) + rules, [self.batch, self.beams, self.vocab])
        else:
            candidates = self._ranked(logits, rules)
        penalty = 1.0 if self.score_is_log_prob else length_penalty(tf.cast(t + 1, tf.float32), self.penalty_form,
                                                                    self.alpha)  # t words + <end>
        chosen_before = tf.zeros([self.batch, self.vocab]) if self.diverse else None
        parts = []
        for group in range(self.groups):
            parts.append(self._group_extended(group, (chosen["alive_logp"], chosen["alive_score"]), candidates, penalty,
                                              chosen_before))
            chosen_before = parts[-1].get("chosen")
        step = {key: parts[0][key] if self.groups == 1 else tf.concat([part[key] for part in parts], axis=1)
                for key in parts[0] if key != "chosen"}
        parent, words = step["parents"], step["words"]
        out = {"alive_logp": step["logp"], "alive_score": step["score"] if self.diverse else step["logp"],
               "alive_ids": chosen["alive_ids"]}
        if self.tracks_ids:
            alive_ids = tf.gather(chosen["alive_ids"], parent, batch_dims=1)
            out["alive_ids"] = alive_ids + words[:, :, None] * tf.one_hot(t, self.max_length, dtype=tf.int32)[None, None]
        over, out["best_done"] = search_over(out["alive_logp"], out["alive_score"], step["end_logp"], step["end_score"],
                                             chosen["best_done"], self.beams, self.groups, self.scores_only_fall)
        grown = {"words": words, "parents": parent, "ends_logp": step["end_logp"], "ends_score": step["end_score"]}
        if self.score_is_log_prob:  # (the same as ends_logp)
            del grown["ends_score"]
            out["ends_score"] = chosen["ends_score"]
        for key, value in grown.items():
            out[key] = tf.concat([chosen[key], value[:, :, None]], axis=2)
        out["weights"] = chosen["weights"]
        if self.attends:  # word t of every live caption was chosen with its parent's weights of this step
            weights = tf.reshape(tf.cast(state["attention"], tf.float32), [self.batch, self.beams, self.cells])
            weights = tf.gather(weights, parent, batch_dims=1) if self.beams > 1 else weights
            out["weights"] = tf.concat([chosen["weights"], weights[:, :, None]], axis=2)
        parents = tf.reshape(self.row_starts + parent, [-1]) if self.beams > 1 else None  # (one beam: its own)
        if self.word_rules:  # each live caption's words are its parent's and its new piece's
            before = chosen if parents is None else self.word_rules.reordered(chosen, parents)
            out.update(self.word_rules.advanced(before, tf.reshape(words, [-1])))
        return tf.reshape(words, [-1]), out, parents, over

    def _group_best(self, group, chosen, ran):
        """Group ``group``'s best complete captions, ranked once among every step's, with the live captions, which
        complete where they are (at max_length words, or where a search that is over stopped: they rank below its
        complete ones): ``beam`` (the live caption each ends in), ``lengths``, ``log_probs``, ``scores`` ``[B, kept]``."""
        size = self.beams_per_group
        group_slice = slice(group * size, (group + 1) * size)
        ends_score = chosen["ends_logp"] if self.score_is_log_prob else chosen["ends_score"]
        alive_logp, alive_score = chosen["alive_logp"][:, group_slice], chosen["alive_score"][:, group_slice]
        last = length_penalty(tf.cast(ran, tf.float32), self.penalty_form, self.alpha)

        def step_major(ends):  # index i < ran * size is step i // size, beam i % size
            return tf.reshape(tf.transpose(ends[:, group_slice], [0, 2, 1]), [self.batch, -1])

        logps = tf.concat([step_major(chosen["ends_logp"]), alive_logp], 1)
        scores = tf.concat([step_major(ends_score), tf.where(alive_logp > DEAD / 2, alive_score / last, DEAD)], 1)
        _, index = tf.math.top_k(tf.where(logps > DEAD / 2, scores, -float("inf")), k=self.kept_per_group)
        real = tf.gather(logps, index, batch_dims=1) > DEAD / 2  # else an empty slot: no words, dead scores
        live = index >= ran * size
        return {"beam": tf.where(real, group * size + tf.where(live, index - ran * size, index % size), 0),
                "lengths": tf.where(real, tf.where(live, ran, index // size), 0),
                "log_probs": tf.where(real, tf.gather(logps, index, batch_dims=1), DEAD),
                "scores": tf.where(real, tf.gather(scores, index, batch_dims=1), DEAD)}

    def _in_turns(self, best_per_group):
        """The groups' captions one group at a time (the groups' best, then their second, ...), each round likeliest
        first by the model's log p (length penalty applied), the first ``top_k``."""
        turns = {key: tf.stack([part[key] for part in best_per_group], axis=2) for key in best_per_group[0]}
        counted = tf.cast(tf.where(turns["lengths"] < self.max_length, turns["lengths"] + 1, turns["lengths"]),
                          tf.float32)  # <end> counts when it came
        likely = tf.where(turns["log_probs"] > DEAD / 2, turns["log_probs"] / length_penalty(
            counted, self.penalty_form, self.alpha), -float("inf"))
        within = tf.argsort(likely, axis=2, direction="DESCENDING", stable=True)
        turns = {key: tf.reshape(tf.gather(value, within, batch_dims=2), [self.batch, self.kept_per_group * self.groups])
                 for key, value in turns.items()}
        order = tf.argsort(tf.cast(turns["log_probs"] <= DEAD / 2, tf.int32), axis=1, stable=True)[:, :self.top_k]
        return {key: tf.gather(value, order, batch_dims=1) for key, value in turns.items()}

    def finish(self, chosen, ran):
        best_per_group = [self._group_best(group, chosen, ran) for group in range(self.groups)]
        best = best_per_group[0] if self.groups == 1 else self._in_turns(best_per_group)
        parents = tf.zeros_like(chosen["words"]) if self.beams == 1 else chosen["parents"]  # one beam: beam 0
        return traced_back(best, chosen["words"], parents, chosen["weights"] if self.attends else None,
                           self.max_length)
