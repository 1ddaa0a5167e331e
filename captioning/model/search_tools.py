"""The beam search's bookkeeping (:mod:`captioning.model.beams`): each live caption's best words, the words a step
never proposes, whether a search can stop, and the captions' words traced back through what each step chose. A
complete caption is kept as the step it ended at and the live caption it ends in; its words and attention weights are
read back only once, at the end, instead of carrying every live caption's words and weights from step to step."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.word_rules import DEAD
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID


def best_of(x, count: int, head=None):
    """``tf.math.top_k(x + head, count).indices`` of ``x [R, V]``, equal values by lower index first as it gives them,
    faster over a vocabulary (1,000 words, count 3, 384 rows, the rules with it: 0.87 against 1.05 CPU ms a call,
    2026-11-26). ``head [H]`` (or None: zeros) is added to the first ``H`` words only (the words never proposed are the
    first four: no sum over the whole vocabulary, which costs a CPU as much as the choice). The words are cut into
    chunks of about 40: a row's best ``count`` lie in the ``count`` chunks whose own best are best (ties by lower index at
    every stage), so the top-k runs over those ``count * chunk`` words, after a max over each chunk (the first chunk's
    with ``head``). A vocabulary of fewer than about ``80 count`` words is ranked whole.

    >>> best_of(tf.constant([[0.0] * 70 + [2.0, 1.0] + [1.0] * 30]), 3).numpy().tolist()
    [[70, 71, 72]]
    >>> best_of(tf.constant([[5.0, 0.0] + [1.0] * 100]), 2, head=tf.constant([-9.0])).numpy().tolist()
    [[2, 3]]
    """
    vocab = x.shape[-1]
    chunk = vocab and min(range(16, 65), key=lambda c: (vocab % c != 0, abs(c - 40)))  # a divisor needs no padding
    chunks = vocab and -(-vocab // chunk)
    if vocab is None or chunks <= 2 * count or head is not None and head.shape[0] > chunk:  # ranked whole
        return tf.math.top_k(x if head is None else x + tf.pad(head, [[0, tf.shape(x)[1] - tf.shape(head)[0]]]),
                             count).indices
    rows = tf.shape(x)[0]
    if chunks * chunk > vocab:  # the last chunk filled with the lowest value: after every word, never chosen first
        x = tf.pad(x, [[0, 0], [0, chunks * chunk - vocab]], constant_values=x.dtype.min)
    blocks = tf.reshape(x, [rows, chunks, chunk])
    best = tf.reduce_max(blocks, axis=2)  # each chunk's best word
    if head is not None:  # the head by chunk (all but the first zeros), and the first chunk's best with it
        head = tf.reshape(tf.pad(head, [[0, chunks * chunk - head.shape[0]]]), [chunks, chunk])
        best = tf.concat([tf.reduce_max(x[:, :chunk] + head[0], axis=1)[:, None], best[:, 1:]], axis=1)
    which = tf.sort(tf.math.top_k(best, count).indices, axis=1)  # in word order
    picked = tf.gather(blocks, which, batch_dims=1)
    if head is not None:
        picked += tf.gather(head, which)
    _, at = tf.math.top_k(tf.reshape(picked, [rows, count * chunk]), count)
    return tf.gather(which, at // chunk, batch_dims=1) * chunk + at % chunk


def log_normalizer(logits, best, of_all: bool = False):
    """Each row's log-sum-exp of ``logits [R, V]`` (a word's log p is its logit minus it), from the softmax's
    probability of the row's likeliest word, which is ``best [R]`` (the likeliest word that may be proposed) or a word
    never proposed (``<pad>``, ``<start>``, ``<unk>``, ``<end>``); ``of_all``: ``best`` is the likeliest of all. Its
    probability is at least 1 / V, so its log never underflows. On a CPU the softmax is faster than the log-softmax
    (oneDNN has a kernel for the one, not the other: 0.52 against 0.88 CPU ms over 384 rows of 1,000 words, 2026-11-26).

    >>> logits = tf.constant([[0.0, 0.0, 0.0, 0.0, 2.0, 1.0]])
    >>> round(float(log_normalizer(logits, tf.constant([4]))[0]), 5) == round(float(tf.reduce_logsumexp(logits)), 5)
    True
    """
    top = best
    if not of_all:
        never = tf.constant([PAD_ID, START_ID, END_ID, UNK_ID], tf.int32)
        candidates = tf.concat([tf.cast(best, tf.int32)[:, None], tf.broadcast_to(never, [tf.shape(best)[0], 4])], 1)
        top = tf.gather(candidates, tf.argmax(tf.gather(logits, candidates, batch_dims=1), axis=1,
                                              output_type=tf.int32), batch_dims=1)
    return tf.gather(logits, top, batch_dims=1) - tf.math.log(tf.gather(tf.nn.softmax(logits), top, batch_dims=1))


def never_proposed(vocab: int, min_length: int):
    """``[2, V]``: the dead score on the words never proposed (``<pad>``, ``<start>``, ``<unk>``): row 0; row 1 also
    on ``<end>``, for the steps before ``min_length`` words (with ``min_length`` 0 only row 0)."""
    never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID, UNK_ID], vocab), axis=0) * DEAD
    return tf.stack([never, never + tf.one_hot(END_ID, vocab) * DEAD]) if min_length else never[None]


def search_over(alive_logp, alive_score, end_logp, end_score, best_done, beams: int, groups: int,
                scores_only_fall: bool):
    """Whether a search can stop after this step, with each group's best complete scores so far ``[B, groups,
    kept]`` (the dead score where it has fewer): no group can change its complete captions any more. With one beam,
    a caption is complete when it ended, and then nothing is live; with scores that only fall (``scores_only_fall``), when
    every group holds ``kept`` complete captions scoring at least its best live one (a tie ranks the earlier caption
    first); else when nothing is live. Dead scores are at most the dead score / 2."""
    if beams == 1:
        return tf.reduce_all(alive_logp <= DEAD / 2), best_done
    batch, kept = tf.shape(alive_logp)[0], best_done.shape[2]
    best_live = tf.reduce_max(tf.reshape(alive_score, [batch, groups, -1]), axis=2)
    if not scores_only_fall:
        return tf.reduce_all(best_live <= DEAD / 2), best_done
    best_done, _ = tf.math.top_k(tf.concat([best_done, tf.reshape(end_score, [batch, groups, -1])], axis=2), k=kept)
    return tf.reduce_all(best_live <= best_done[:, :, -1]), best_done


def one_loop(keep_going, step, variables: dict, shapes: dict | None = None) -> dict:
    """``tf.while_loop`` over a dict of loop ``variables``: while ``keep_going(v)``, ``v = step(v)`` (a dict of the
    same keys). ``shapes``: the shape invariants of the variables whose shape changes (a nest like the variable's);
    the others keep theirs. The project's graph code is written without AutoGraph (docs/architecture.md).

    >>> float(one_loop(lambda v: v["i"] < 3, lambda v: {"i": v["i"] + 1, "x": v["x"] * 2}, {"i": 0, "x": 1.0})["x"])
    8.0
    """
    variables = tf.nest.map_structure(lambda x: x if isinstance(x, tf.TensorArray) else tf.convert_to_tensor(x),
                                      variables)
    invariants = {key: (shapes or {}).get(key, tf.nest.map_structure(lambda x: None, value))  # None: its own
                  for key, value in variables.items()}
    return tf.while_loop(keep_going, lambda v: [step(v)], [variables], shape_invariants=[invariants])[0]


def traced_back(captions: dict, words, parents, weights, steps: int) -> dict:
    """``captions`` (``beam``: the live caption each ends in after its last word, ``lengths``, ...: [B, M]) with
    their words ``ids [B, M, steps]`` (and, given the steps' ``weights [B, K, ran, G]``, ``attention [B, M, steps,
    G]``) traced back through each step's ``words`` and ``parents`` ``[B, K, ran]``, 0 after each caption's end.

    >>> words = tf.constant([[[4, 6], [5, 7]]])    # step 0 chose 4 and 5; step 1: 6 after beam 1, 7 after beam 0
    >>> parents = tf.constant([[[0, 1], [0, 0]]])
    >>> out = traced_back({"beam": tf.constant([[0, 1]]), "lengths": tf.constant([[2, 1]])}, words, parents, None, 3)
    >>> out["ids"].numpy().tolist()
    [[[5, 6, 0], [5, 0, 0]]]
    """
    out = {key: value for key, value in captions.items() if key != "beam"}
    lengths, current = captions["lengths"], captions["beam"]
    ran = tf.shape(words)[2]
    has_weights = weights is not None
    attention = tf.zeros(tf.concat([tf.shape(lengths), [0], tf.shape(weights)[3:]], 0)) if has_weights else tf.zeros([0])

    def one_step(v):  # a step, from the last back to the first
        step, current = v["step"], v["current"]
        inside = step < lengths  # the caption has a word at this step
        word = tf.gather(words[:, :, step], current, batch_dims=1)
        out = {"step": step - 1, "current": tf.where(inside, tf.gather(parents[:, :, step], current, batch_dims=1), current),
               "ids": tf.concat([tf.where(inside, word, 0)[:, :, None], v["ids"]], axis=2), "attention": v["attention"]}
        if has_weights:
            chosen = tf.gather(weights[:, :, step], current, batch_dims=1)
            out["attention"] = tf.concat([tf.where(inside[:, :, None], chosen, 0.0)[:, :, None], v["attention"]], 2)
        return out

    loop = one_loop(lambda v: v["step"] >= 0, one_step, {
        "step": ran - 1, "current": current, "ids": tf.zeros(tf.concat([tf.shape(lengths), [0]], 0), tf.int32),
        "attention": attention}, {"ids": tf.TensorShape([None, None, None]),
                                  "attention": tf.TensorShape([None, None, None, None] if has_weights else [0])})
    ids, attention = loop["ids"], loop["attention"]
    out["ids"] = tf.pad(ids, [[0, 0], [0, 0], [0, steps - ran]])
    if has_weights:
        out["attention"] = tf.pad(attention, [[0, 0], [0, 0], [0, steps - ran], [0, 0]])
    return out
