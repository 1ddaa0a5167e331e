"""Beam search against independent references: a hand-written greedy loop and exhaustive search."""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf

from captioning.model.decode import beam_search, ids_to_text
from captioning.model.search_tools import best_of
from captioning.model.sampling import sample_search
from captioning.errors import InputError
from captioning.model import build_model
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID, Vocabulary
from tests.helpers import model_config

WORDS = [4, 5, 6]  # three words; with <pad>, <start>, <end> and <unk> (never proposed) the vocabulary has 7 ids


def tiny_model(seed, end_bias=0.0, vocab=7, size=16, decoder="show_and_tell"):
    """A random model whose distributions are far from uniform (large init); a negative bias on <end>
    makes longer captions likely. Built once a process for each set of arguments (the tests only read it)."""
    return _built(seed, float(end_bias), vocab, size, decoder)


@functools.lru_cache(maxsize=None)
def _built(seed, end_bias, vocab, size, decoder):
    import keras

    keras.utils.set_random_seed(seed)  # the encoder's own initialisers are not seeded: the same model every run
    cfg = model_config(decoder=decoder, encoder="small_cnn", embedding_size=8, lstm_units=8, dropout=0.0,
                       init_scale=1.2)
    model = build_model(vocab, cfg, size, seed=seed).build_all()
    bias = model.logits.bias.numpy()
    bias[END_ID] += end_bias
    model.logits.bias.assign(bias)
    return model


def images(n, size=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3)).astype("uint8")


def log_probs(model, features, sequences):
    """Summed log-probability of each of ``sequences`` (word ids, then <end> if present), sequence i for the image of
    ``features[i]``: all of them stepped as one batch, an eager step a word (a shorter one's later steps count
    nothing)."""
    steps = max(map(len, sequences))
    tokens = np.full((len(sequences), max(steps, 1)), END_ID, np.int32)  # what each step reads
    tokens[:, 0] = START_ID
    for i, sequence in enumerate(sequences):
        tokens[i, 1:len(sequence)] = sequence[:-1]
    state = model.initial_state(tf.constant(np.asarray(features)))
    totals = [0.0] * len(sequences)
    for t in range(steps):
        logits, state = model.step(tf.constant(tokens[:, t]), state)
        logp = tf.nn.log_softmax(logits).numpy()
        for i, sequence in enumerate(sequences):
            if t < len(sequence):
                totals[i] += float(logp[i, sequence[t]])
    return totals


def log_prob(model, features, sequence):
    """Summed log-probability of ``sequence`` (word ids, then <end> if present) for one image."""
    return log_probs(model, np.asarray(features)[None], [list(sequence)])[0]


def allowed(words, word, block_ngrams=0, bad_endings=()):
    """Whether ``word`` may follow ``words`` under the blocking rules, checked by brute force."""
    if word == END_ID:
        return not (words and words[-1] in bad_endings)
    if block_ngrams >= 1 and words and words[-1] == word:
        return False
    if block_ngrams >= 2:
        longer = words + [word]
        grams = [tuple(longer[i:i + block_ngrams]) for i in range(len(longer) - block_ngrams + 1)]
        return len(grams) == len(set(grams))
    return True


def greedy_reference(model, features, max_length, block_ngrams=0, bad_endings=()):
    """The most likely allowed word at each step (never <pad>, <start> or <unk>), until <end> or max_length
    words."""
    state = model.initial_state(features)  # every image a row, stepped together (an ended row's steps ignored)
    out, done = [[] for _ in range(len(features))], [False] * len(features)
    tokens = [START_ID] * len(features)
    for _ in range(max_length):
        logits, state = model.step(tf.constant(tokens, tf.int32), state)
        for row, (words, row_logits) in enumerate(zip(out, logits.numpy())):
            if done[row]:
                continue
            row_logits[[PAD_ID, START_ID, UNK_ID]] = -np.inf
            for w in range(len(row_logits)):
                if not allowed(words, w, block_ngrams, bad_endings):
                    row_logits[w] = -np.inf
            tokens[row] = int(np.argmax(row_logits))
            done[row] = tokens[row] == END_ID
            if not done[row]:
                words.append(tokens[row])
    return out


@pytest.mark.parametrize("seed, end_bias, max_length", [(1, 0.0, 6), (2, -2.0, 6), (3, -6.0, 4)])
def test_beam_of_one_is_greedy(seed, end_bias, max_length):
    model = tiny_model(seed, end_bias)
    features = model.encode(images(6, seed=seed))
    expected = greedy_reference(model, features, max_length)
    out = tf.function(lambda f: beam_search(model, f, beam_size=1, max_length=max_length), autograph=False)(features)
    got = [list(row[0][:n]) for row, n in zip(out["ids"].numpy(), out["lengths"].numpy()[:, 0])]
    assert got == expected
    assert any(len(e) == max_length for e in expected) or end_bias == 0.0  # some hit max_length
    rescored = log_probs(model, features, [words + ([END_ID] if len(words) < max_length else []) for words in expected])
    for lp, rescored_lp in zip(out["log_probs"].numpy()[:, 0], rescored):
        assert lp == pytest.approx(rescored_lp, abs=1e-4)


def exhaustive(model, f, max_length):
    """Every caption of at most max_length words: (log_prob, words), best first (all scored in one batch)."""
    every = [list(words) for n in range(max_length + 1) for words in itertools.product(WORDS, repeat=n)]
    scored = log_probs(model, np.repeat(np.asarray(f)[None], len(every), axis=0),
                       [words + ([END_ID] if len(words) < max_length else []) for words in every])
    return sorted(zip(scored, every), key=lambda s: -s[0])


@pytest.mark.parametrize("seed", [4, 5])
def test_large_beam_finds_the_exhaustive_optimum(seed):
    model = tiny_model(seed, end_bias=-1.5)
    features = model.encode(images(2, seed=seed))
    out = beam_search(model, features, beam_size=64, max_length=3, top_k=3)
    for i, f in enumerate(features):
        best = exhaustive(model, f, 3)
        for rank in range(3):  # the three best captions, in order, with their exact log-probabilities
            n = int(out["lengths"][i, rank])
            assert list(out["ids"][i, rank, :n].numpy()) == best[rank][1]
            assert float(out["log_probs"][i, rank]) == pytest.approx(best[rank][0], abs=1e-4)
        assert not out["ids"][i, 0, int(out["lengths"][i, 0]):].numpy().any()  # zero after the caption


def with_end(words, max_length=3):
    """A caption's length as the penalty counts it: its words and ``<end>``, which it has below max_length."""
    return len(words) + (len(words) < max_length)


def penalised(best, form, alpha, counted=with_end, divide=True):
    """``exhaustive``'s captions ranked by the length-penalised score, written out here apart from decode.py:
    (score, log_prob, words), best first; the score is log_prob / length ** α (``avg``) or / ((5 + length) / 6)
    ** α (``gnmt``). ``counted`` and ``divide`` may apply it otherwise (a deliberately wrong reference)."""
    def score(lp, words):
        n = counted(words)
        penalty = n ** alpha if form == "avg" else ((5 + n) / 6) ** alpha
        return lp / penalty if divide else lp * penalty
    return sorted(((score(lp, words), lp, words) for lp, words in best), key=lambda s: -s[0])


@pytest.mark.parametrize("form, alpha, seed", [("avg", 1.0, 5), ("avg", 0.7, 11), ("gnmt", 2.0, 5)])
def test_large_beam_finds_the_exhaustive_optimum_under_a_length_penalty(form, alpha, seed):
    """With α > 0 a beam as wide as the search space (3 words, at most 3 of them: 40 captions, 27 live at most)
    returns the three best captions of exhaustive search ranked by the penalised score, in order, with their
    log-probabilities and scores. On these models that ranking differs from α = 0's, from one counting the
    words without ``<end>``, from one multiplying by the penalty and from the other form's: a beam applying
    the penalty in any of those ways would fail here."""
    model = tiny_model(seed)
    features = model.encode(images(2, seed=seed))
    out = beam_search(model, features, beam_size=64, max_length=3, top_k=3, length_normalization=alpha,
                      length_penalty_form=form)
    for i, f in enumerate(features):
        best = exhaustive(model, f, 3)
        right = penalised(best, form, alpha)
        top = [words for _, _, words in right[:3]]
        wrong = [penalised(best, form, 0.0), penalised(best, form, alpha, counted=lambda words: max(len(words), 1)),
                 penalised(best, form, alpha, divide=False), penalised(best, "gnmt" if form == "avg" else "avg", alpha)]
        assert all(top != [words for _, _, words in other[:3]] for other in wrong), (top, wrong)
        for rank in range(3):
            n = int(out["lengths"][i, rank])
            assert list(out["ids"][i, rank, :n].numpy()) == top[rank]
            assert float(out["log_probs"][i, rank]) == pytest.approx(right[rank][1], abs=1e-4)
            assert float(out["scores"][i, rank]) == pytest.approx(right[rank][0], abs=1e-4)


def test_returned_scores_are_the_models_log_probabilities():
    model = tiny_model(6, end_bias=-1.0)
    features = model.encode(images(3, seed=6))
    out = beam_search(model, features, beam_size=3, max_length=5, top_k=3)
    for i, f in enumerate(features):
        scores = out["log_probs"][i].numpy()
        assert list(scores) == sorted(scores, reverse=True)
        for rank in range(3):
            n = int(out["lengths"][i, rank])
            words = list(out["ids"][i, rank, :n].numpy())
            sequence = words + ([END_ID] if n < 5 else [])
            assert float(scores[rank]) == pytest.approx(log_prob(model, f, sequence), abs=1e-4)
            assert float(out["scores"][i, rank]) == pytest.approx(float(scores[rank]), abs=1e-6)


def test_length_normalisation_ranks_by_mean_log_probability():
    model = tiny_model(7, end_bias=-1.0)
    features = model.encode(images(2, seed=7))
    out = beam_search(model, features, beam_size=4, max_length=5, length_normalization=1.0, top_k=4)
    lengths, log_probs, scores = (out[k].numpy() for k in ("lengths", "log_probs", "scores"))
    counted = np.where(lengths < 5, lengths + 1, lengths)  # <end> counts when the caption completed
    np.testing.assert_allclose(scores, log_probs / counted, rtol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()


@pytest.mark.parametrize("block_ngrams, bad_endings, end_bias, seed", [
    (1, (), -4.0, 8), (2, (), -4.0, 8), (3, (), -4.0, 8), (0, (4, 6), -0.5, 10), (2, (6,), -0.5, 10)])
def test_blocking_inside_the_search_equals_a_brute_force_greedy_and_never_repeats(block_ngrams, bad_endings,
                                                                                  end_bias, seed):
    """Greedy decoding with n-gram blocking and bad endings equals a hand-written greedy loop applying the
    same rules; a beam of 4 never produces a repeated n-gram, a word twice in a row, or a bad ending."""
    model = tiny_model(seed, end_bias=end_bias)
    features = model.encode(images(6, seed=seed))
    options = {"block_ngrams": block_ngrams, "bad_endings": bad_endings, "max_length": 6}
    out = tf.function(lambda f: beam_search(model, f, beam_size=1, **options), autograph=False)(features)
    got = [list(row[0][:n]) for row, n in zip(out["ids"].numpy(), out["lengths"].numpy()[:, 0])]
    assert got == greedy_reference(model, features, 6, block_ngrams, bad_endings)
    plain = beam_search(model, features, beam_size=1, max_length=6)
    assert not np.array_equal(plain["ids"].numpy(), out["ids"].numpy())  # the rules did change something
    wide = beam_search(model, features, beam_size=4, top_k=4, **options)
    for row, lengths in zip(wide["ids"].numpy(), wide["lengths"].numpy()):
        for ids, n in zip(row, lengths):
            words = list(ids[:n])
            assert all(allowed(words[:i], w, block_ngrams) for i, w in enumerate(words))
            if 0 < n < 6 and bad_endings:
                assert words[-1] not in bad_endings


def test_the_gnmt_length_penalty():
    model = tiny_model(7, end_bias=-1.0)
    features = model.encode(images(2, seed=7))
    out = beam_search(model, features, beam_size=4, max_length=5, length_normalization=0.7, top_k=4,
                      length_penalty_form="gnmt")
    lengths, log_probs, scores = (out[k].numpy() for k in ("lengths", "log_probs", "scores"))
    counted = np.where(lengths < 5, lengths + 1, lengths)
    np.testing.assert_allclose(scores, log_probs / ((5 + counted) / 6) ** 0.7, rtol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()
    none = beam_search(model, features, beam_size=4, max_length=5, length_normalization=0.7, top_k=4,
                       length_penalty_form="none")
    np.testing.assert_allclose(none["scores"].numpy(), none["log_probs"].numpy(), rtol=1e-6)


@pytest.mark.parametrize("vocab", [12, 65, 997, 1000, 9487])
def test_the_beams_chunked_top_k_is_tensorflows_ties_included(vocab):
    """best_of (the beam's words per live caption) gives tf.math.top_k's indices, equal values by lower index first:
    on random logits and on rows of only 3 distinct values (ties everywhere), a vocabulary that chunks of about 40 divide
    (1,000) and ones they do not (997, 9,487: padded), and ones too small to chunk; with a ``head`` added to the first
    words (the never-proposed words' rules, dead or 0, and a head whose values tie with the other words) as top_k of
    the sum."""
    rng = np.random.default_rng(vocab)
    heads = [None, tf.constant([-1e9, -1e9, 0.0, -1e9]), tf.constant([-1e9, 0.0, 1.0])]
    for x in (rng.normal(size=(40, vocab)), rng.integers(0, 3, size=(40, vocab))):
        x = tf.constant(x, tf.float32)
        for k in (1, 2, 3, 5, 7):
            for head in heads:
                summed = x if head is None else x + tf.pad(head, [[0, vocab - head.shape[0]]])
                np.testing.assert_array_equal(best_of(x, k, head).numpy(), tf.math.top_k(summed, k).indices.numpy())


def test_top_k_cannot_exceed_the_beam():
    with pytest.raises(ValueError, match="top_k"):
        beam_search(tiny_model(1), tf.zeros([1, 512]), beam_size=2, top_k=3)


def test_ids_to_text():
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "red", "circle"])
    assert ids_to_text(vocab, np.array([[[4, 5, 0], [5, 0, 0]]]), np.array([[2, 1]])) == [["red circle", "circle"]]


def sampled(model, features, keys, **options):
    out = sample_search(model, model.initial_state(features), keys=tf.constant(keys, tf.int64), **options)
    return [[tuple(ids[:n]) for ids, n in zip(row, lengths)]
            for row, lengths in zip(out["ids"].numpy(), out["lengths"].numpy())], out


def test_sampling_is_seeded_per_image_whatever_the_batch():
    """The same seed and image keys give the same captions alone, in a batch, in another order; another seed
    gives others; each caption's log-probability is the model's."""
    model = tiny_model(11, end_bias=-1.0)
    features = model.encode(images(6, seed=11))
    keys = [101, 102, 103, 104, 105, 106]
    options = {"samples": 4, "max_length": 6, "seed": 5}
    together, out = sampled(model, features, keys, **options)
    alone = [sampled(model, features[i:i + 1], keys[i:i + 1], **options)[0][0] for i in (0, 3)]
    assert alone == [together[0], together[3]]
    backwards = sampled(model, features[::-1], keys[::-1], **options)[0]
    assert backwards[::-1] == together
    assert sampled(model, features, keys, **{**options, "seed": 6})[0] != together
    assert len({c for row in together for c in row}) > 6  # samples differ within and between images
    rescored = log_probs(model, np.repeat(features.numpy(), 4, axis=0), [
        list(words) + ([END_ID] if len(words) < 6 else []) for row in together for words in row])
    np.testing.assert_allclose(out["log_probs"].numpy(), np.reshape(rescored, (6, 4)), atol=1e-4, rtol=0)
    for i in range(6):
        assert list(out["log_probs"][i].numpy()) == sorted(out["log_probs"][i].numpy(), reverse=True)


def test_sampling_follows_the_models_distribution_and_its_limits_are_greedy():
    model = tiny_model(12, end_bias=-1.0)
    features = model.encode(images(1, seed=12))
    logits, _ = model.step(tf.constant([START_ID]), model.initial_state(features))
    p = tf.nn.softmax(logits).numpy()[0]
    p[[PAD_ID, START_ID, UNK_ID]] = 0
    p /= p.sum()
    out = sample_search(model, model.initial_state(features), max_length=1, samples=4000, seed=1,
                        keys=tf.constant([7], tf.int64))
    first = np.where(out["lengths"].numpy()[0] > 0, out["ids"].numpy()[0, :, 0], END_ID)
    frequency = np.bincount(first, minlength=len(p)) / len(first)
    np.testing.assert_allclose(frequency, p, atol=0.03)  # 4,000 draws: a few standard errors
    greedy = beam_search(model, features, beam_size=1, max_length=6)
    for options in ({"temperature": 1e-3}, {"sample_top_k": 1}, {"sample_top_p": 1e-6}):
        cold = sample_search(model, model.initial_state(features), max_length=6, samples=2, seed=3,
                             keys=tf.constant([1], tf.int64), **options)
        for j in range(2):
            assert cold["ids"][0, j].numpy().tolist() == greedy["ids"][0, 0].numpy().tolist(), options


def test_diverse_beam_search():
    """One group is beam search; groups without a diversity penalty search alike (each as a beam of its size);
    with a strong penalty every group's caption starts with another word."""
    model = tiny_model(13, end_bias=-1.0)
    features = model.encode(images(4, seed=13))
    plain = beam_search(model, features, beam_size=4, top_k=2, max_length=5)
    one = beam_search(model, features, beam_size=4, top_k=2, max_length=5, beam_groups=1, diversity=5.0)
    for key in ("ids", "lengths", "log_probs"):
        np.testing.assert_array_equal(one[key].numpy(), plain[key].numpy())
    alike = beam_search(model, features, beam_size=4, top_k=1, max_length=5, beam_groups=2)
    half = beam_search(model, features, beam_size=2, top_k=1, max_length=5)
    np.testing.assert_array_equal(alike["ids"].numpy(), half["ids"].numpy())
    diverse = beam_search(model, features, beam_size=3, top_k=3, max_length=5, beam_groups=3, diversity=100.0)
    for i, f in enumerate(features.numpy()):
        firsts = [int(diverse["ids"][i, r, 0]) for r in range(3) if diverse["lengths"][i, r] > 0]
        assert len(firsts) == len(set(firsts)) >= 2
        for r in range(3):  # the reported log-probabilities stay the model's, without the penalty
            n = int(diverse["lengths"][i, r])
            sequence = list(diverse["ids"][i, r, :n].numpy()) + ([END_ID] if n < 5 else [])
            assert float(diverse["log_probs"][i, r]) == pytest.approx(log_prob(model, f, sequence), abs=1e-4)
    with pytest.raises(ValueError, match="must divide"):
        beam_search(model, features, beam_size=4, beam_groups=3)


def diverse_reference(model, f, groups, per, diversity, max_length):
    """Diverse beam search for one image by hand (Vijayakumar et al.'s Algorithm 1 with im2txt's beams): each
    group a beam search of ``per`` beams whose words are ranked, and whose captions are scored, by the log p
    minus ``diversity`` × the captions of earlier groups that chose the word at this step (<end> included).
    Returns each group's complete captions, best first: [(score, log p, words)]."""
    start = model.initial_state(f[None])
    beams = [[(0.0, 0.0, [], start)] for _ in range(groups)]  # (score, log p, words, state)
    done = [[] for _ in range(groups)]
    for _ in range(max_length):
        chosen = np.zeros(model.vocab_size)
        for g in range(groups):
            candidates = []
            for score, lp, words, state in beams[g]:
                logits, after = model.step(tf.constant([words[-1] if words else START_ID]), state)
                logp = tf.nn.log_softmax(logits).numpy()[0].astype(np.float64)
                logp[[PAD_ID, START_ID, UNK_ID]] = -np.inf
                ranked = logp - diversity * chosen
                for w in np.argsort(-ranked, kind="stable")[:min(per, model.vocab_size)]:
                    candidates.append((score + ranked[w], lp + logp[w], words + [int(w)], after))
            ends = [c for c in candidates if c[2][-1] == END_ID]
            done[g] += [(s, lp, words[:-1]) for s, lp, words, _ in ends]
            beams[g] = sorted((c for c in candidates if c[2][-1] != END_ID), key=lambda c: -c[0])[:per]
            for c in beams[g]:
                chosen[c[2][-1]] += 1
            chosen[END_ID] += len(ends)
    return [sorted(done[g] + [(s, lp, words) for s, lp, words, _ in beams[g]], key=lambda c: -c[0])
            for g in range(groups)]


@pytest.mark.parametrize("groups, per, diversity, end_bias", [
    (3, 1, 0.3, -1.0), (3, 1, 5.0, -1.0), (2, 2, 0.7, -1.0), (2, 2, 0.4, 1.5)])
def test_diverse_beam_search_follows_the_reference_with_the_penalised_score_carried_forward(groups, per, diversity,
                                                                                            end_bias):
    """Every caption, log p and score of every group equal a hand-written diverse beam search (the penalised score
    carried forward, an earlier group's <end> counted), returned one per group in turn (each round likeliest
    first)."""
    model = tiny_model(14, end_bias=end_bias)
    features = model.encode(images(2, seed=14))
    k = groups * per
    out = beam_search(model, features, beam_size=k, top_k=k, max_length=4, beam_groups=groups, diversity=diversity)
    for i, f in enumerate(features):
        found = diverse_reference(model, f, groups, per, diversity, 4)
        # one per group in turn: the groups' best, then their second ones, each round by the model's log p
        expected = [c for r in range(per) for c in sorted((found[g][r] for g in range(groups)), key=lambda c: -c[1])]
        for rank in range(k):
            score, lp, words = expected[rank]
            n = int(out["lengths"][i, rank])
            assert list(out["ids"][i, rank, :n].numpy()) == words
            assert float(out["log_probs"][i, rank]) == pytest.approx(lp, abs=1e-4)
            assert float(out["scores"][i, rank]) == pytest.approx(score, abs=1e-4)


def test_the_diversity_penalty_at_a_step_counts_earlier_groups_ends_and_is_carried():
    """At the first step each later group pays λ per earlier group that chose the same word, <end> included
    (a model whose first word is <end>); after it the penalty stays in the score; k captions come from k groups."""
    model = tiny_model(15, end_bias=6.0)  # <end> is by far the likeliest first word
    features = model.encode(images(2, seed=15))
    out = beam_search(model, features, beam_size=3, top_k=3, max_length=1, beam_groups=3, diversity=0.25)
    np.testing.assert_array_equal(out["lengths"].numpy(), 0)  # all three chose <end>: empty captions
    np.testing.assert_allclose(out["log_probs"].numpy() - out["scores"].numpy(), [[0.0, 0.25, 0.5]] * 2, atol=1e-5)
    model = tiny_model(15, end_bias=-6.0)
    features = model.encode(images(2, seed=15))
    out = beam_search(model, features, beam_size=2, top_k=2, max_length=3, beam_groups=2, diversity=0.01)
    ids = out["ids"].numpy()
    same = (ids[:, 0] == ids[:, 1]).sum(axis=1)  # the words both groups chose: 0.01 each, carried to the end
    paid = np.sort(out["log_probs"].numpy() - out["scores"].numpy(), axis=1)  # the first group pays nothing
    np.testing.assert_allclose(paid, np.stack([np.zeros(2), 0.01 * same], axis=1), atol=1e-5)
    assert same.min() >= 1
    # without a penalty, 3 groups of 2 are 3 beam searches of 2: the 3 captions returned are each group's best
    alike = beam_search(model, features, beam_size=6, top_k=3, max_length=5, beam_groups=3)
    best = beam_search(model, features, beam_size=2, top_k=1, max_length=5)
    for rank in range(3):
        np.testing.assert_array_equal(alike["ids"][:, rank].numpy(), best["ids"][:, 0].numpy())


def test_top_k_then_top_p_measures_the_nucleus_in_the_renormalised_top_k():
    from captioning.model.sampling import filtered

    p = tf.exp(filtered(tf.math.log([[0.5, 0.3, 0.15, 0.05]]), top_k=2, top_p=0.6)).numpy()[0]
    np.testing.assert_allclose(p, [1.0, 0.0, 0.0, 0.0], atol=1e-6)  # 0.5 / 0.8 = 0.625 reaches 0.6: one word
    p = tf.exp(filtered(tf.math.log([[0.5, 0.3, 0.15, 0.05]]), top_k=3, top_p=0.6)).numpy()[0]
    np.testing.assert_allclose(p, [0.625, 0.375, 0.0, 0.0], atol=1e-6)  # 0.5 / 0.95 < 0.6: two


@pytest.mark.parametrize("method, beam", [("beam", 10), ("greedy", 1), ("sample", 3)])
def test_a_caption_has_at_least_one_word_when_end_is_the_likeliest_first_word(method, beam):
    """A model whose first word is <end> by far: plain beam search gives the empty caption, every decoding
    method of `generate` (caption, evaluate, export) gives a caption of at least one word."""
    from captioning.config import DecodeConfig
    from captioning.model.decode import generate

    model = tiny_model(16, end_bias=8.0, vocab=12)
    features = model.encode(images(3, seed=16))
    empty = beam_search(model, features, beam_size=10, top_k=10, max_length=5)
    assert (empty["lengths"].numpy()[:, 0] == 0).all()
    settings = DecodeConfig(method=method, beam_size=beam, top_k=beam if method != "greedy" else 1, max_length=5)
    out = generate(model, model.initial_state(features), settings, keys=tf.constant([1, 2, 3], tf.int64))
    lengths = out["lengths"].numpy()
    assert lengths.shape == (3, settings.top_k) and (lengths >= 1).all()
    for i, f in enumerate(features):  # the log p reported is the model's (its <end> included)
        n = int(lengths[i, 0])
        words = list(out["ids"][i, 0, :n].numpy())
        assert float(out["log_probs"][i, 0]) == pytest.approx(log_prob(model, f, words + [END_ID] * (n < 5)),
                                                              abs=1e-4)


def test_empty_best_captions_are_counted_in_one_line():
    from captioning.model.decode import empty_captions_warning

    assert empty_captions_warning(["a red circle", "a blue star"]) is None
    line = empty_captions_warning(["", "a red circle", "", ""])
    assert line.startswith("3 of 4 best captions are empty") and "\n" not in line


@pytest.mark.parametrize("decoder", ["show_and_tell", "attention"])
@pytest.mark.parametrize("options", [{}, {"block_ngrams": 2, "min_length": 2}, {"bad_endings": (5,)},
                                     {"length_normalization": 0.7}, {"length_penalty_form": "gnmt",
                                                                     "length_normalization": 1.0}])
def test_the_greedy_loop_gives_what_a_beam_of_one_gives(decoder, options):
    """A beam of 1 runs its own strategy of a few ops a step (greedy.Greedy): the same ids, lengths, log-probabilities,
    scores and attention weights as the beam search of one beam, every option on, captions that end early and
    captions that reach max_length alike."""
    # (the <end> bias measured: some captions end, some are cut)
    model = tiny_model(4, end_bias=0.3 if decoder == "show_and_tell" else 1.0, decoder=decoder)
    features = model.encode(images(8, seed=4))
    fast = beam_search(model, features, beam_size=1, max_length=5, **options)
    slow = beam_search(model, features, beam_size=1, max_length=5, fast_greedy=False, **options)
    # decode.jit_compile: compiled by XLA, with the rules that add ops to the loop (the length penalties are finish's;
    # greedy without rules compiled is the decoder contract's, over every decoder: tests/harness/decoder_contract.py)
    xla = beam_search(model, features, beam_size=1, max_length=5, jit_compile=True, **options) if options and (
        "length_normalization" not in options) else slow
    assert sorted(fast) == sorted(slow) == sorted(xla) and ("attention" in fast) == (decoder == "attention")
    lengths = fast["lengths"].numpy()[:, 0]
    assert (lengths < 5).any() and (lengths == 5).any() or options  # some end, some are cut (options change that)
    for key in slow:
        np.testing.assert_allclose(fast[key].numpy(), slow[key].numpy(), atol=1e-6, err_msg=key)
        np.testing.assert_allclose(xla[key].numpy(), slow[key].numpy(), atol=1e-5, err_msg=key)


def test_decode_jit_compile_serves_greedy_decoding_and_refuses_the_searches_xla_cannot_compile():
    """``decode.jit_compile``: greedy (method greedy, or a beam of 1) is compiled; beam search and sampling are
    refused in one line by the config, and by the loop itself (which names why)."""
    from captioning.config import DecodeConfig
    from captioning.model.beams import BeamSearch
    from captioning.model.sampling import Sampling
    from captioning.model.search_loop import search

    DecodeConfig(method="greedy", jit_compile=True).check("decode.")
    DecodeConfig(method="beam", beam_size=1, jit_compile=True).check("decode.")
    for settings in ({"method": "beam"}, {"method": "sample"}):
        with pytest.raises(InputError, match=r"^decode.jit_compile compiles greedy decoding only .*set "
                                             r"decode.jit_compile false$"):
            DecodeConfig(jit_compile=True, **settings).check("decode.")
    model = tiny_model(17, vocab=12)
    state = model.initial_state(model.encode(images(2, seed=17)))
    with pytest.raises(ValueError, match=r"grow a step at a time"):
        search(model, state, BeamSearch(model, 3, 4), 4, jit_compile=True)
    with pytest.raises(ValueError, match=r"hash each row's seed as text"):
        search(model, state, Sampling(model, max_length=4), 4, jit_compile=True)


@pytest.mark.parametrize("beam", [3, 1])
def test_the_decoder_steps_floor_runs_exactly_the_steps_the_search_ran(beam):
    """`benchmark decode`'s floor (the decoder's own steps, the one loop with DecoderSteps) calls the decoder's step
    exactly as many times as the search did, over as many rows, also when the search stops before max_length."""
    from captioning.config import DecodeConfig
    from captioning.model.decode import generate_counted
    from captioning.model.search_loop import DecoderSteps, search

    model = tiny_model(16, end_bias=3.0, vocab=12)  # captions end early: the search stops before max_length

    class Counted:  # the model, counting its steps' calls and rows (eager: the loop's body runs in Python)
        vocab_size, attends, reserve = model.vocab_size, model.attends, model.reserve
        calls = []

        def step(self, tokens, state):
            self.calls.append(int(tokens.shape[0]))
            return model.step(tokens, state)

    state = model.initial_state(model.encode(images(4, seed=16)))
    settings = DecodeConfig(method="beam" if beam > 1 else "greedy", beam_size=beam, top_k=1, max_length=12)
    counted = Counted()
    captions, ran, rows_per_image = generate_counted(counted, state, settings)
    searched = list(counted.calls)
    assert rows_per_image == beam and len(searched) == int(ran) < 12 and set(searched) == {4 * beam}
    counted.calls.clear()
    logits, floor_ran = search(counted, state, DecoderSteps(rows_per_image, model.vocab_size), 12, tf.constant(ran))
    assert int(floor_ran) == int(ran) and counted.calls == searched and logits.shape == (4 * beam, 12)
