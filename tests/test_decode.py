"""Beam search against independent references: a hand-written greedy loop and exhaustive search."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from captioning.model.decode import beam_search, ids_to_text
from captioning.model import ShowAndTell
from captioning.vocab import END_ID, PAD_ID, START_ID, Vocabulary
from tests.helpers import model_config

WORDS = [3, 4, 5, 6]  # <unk> and three words; with <pad>, <start>, <end> the vocabulary has 7 ids


def tiny_model(seed, end_bias=0.0, vocab=7, size=16):
    """A random model whose distributions are far from uniform (large init); a negative bias on <end>
    makes longer captions likely."""
    cfg = model_config(encoder="small_cnn", embedding_size=8, lstm_units=8, dropout=0.0, init_scale=1.2)
    model = ShowAndTell(vocab, cfg, size, seed=seed).build_all()
    bias = model.logits.bias.numpy()
    bias[END_ID] += end_bias
    model.logits.bias.assign(bias)
    return model


def images(n, size=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3)).astype("uint8")


def log_prob(model, features, sequence):
    """Summed log-probability of ``sequence`` (word ids, then <end> if present) for one image."""
    state = model.initial_state(features[None])
    token, total = START_ID, 0.0
    for word in sequence:
        logits, state = model.step(tf.constant([token]), state)
        total += float(tf.nn.log_softmax(logits)[0, word])
        token = word
    return total


def greedy_reference(model, features, max_length):
    """The most likely word at each step (never <pad> or <start>), until <end> or max_length words."""
    out = []
    for f in features:
        state = model.initial_state(f[None])
        token, words = START_ID, []
        for _ in range(max_length):
            logits, state = model.step(tf.constant([token]), state)
            logits = logits.numpy()[0]
            logits[[PAD_ID, START_ID]] = -np.inf
            token = int(np.argmax(logits))
            if token == END_ID:
                break
            words.append(token)
        out.append(words)
    return out


@pytest.mark.parametrize("seed, end_bias, max_length", [(1, 0.0, 6), (2, -2.0, 6), (3, -6.0, 4)])
def test_beam_of_one_is_greedy(seed, end_bias, max_length):
    model = tiny_model(seed, end_bias)
    features = model.encode(images(6, seed=seed))
    expected = greedy_reference(model, features, max_length)
    out = tf.function(lambda f: beam_search(model, f, beam_size=1, max_length=max_length))(features)
    got = [list(row[0][:n]) for row, n in zip(out["ids"].numpy(), out["lengths"].numpy()[:, 0])]
    assert got == expected
    assert any(len(e) == max_length for e in expected) or end_bias == 0.0  # some hit max_length
    for f, words, lp, n in zip(features, expected, out["log_probs"].numpy()[:, 0], out["lengths"].numpy()[:, 0]):
        complete = len(words) < max_length
        assert lp == pytest.approx(log_prob(model, f, words + ([END_ID] if complete else [])), abs=1e-4)


def exhaustive(model, f, max_length):
    """Every caption of at most max_length words: (log_prob, words), best first."""
    scored = []
    for n in range(max_length + 1):
        for words in itertools.product(WORDS, repeat=n):
            sequence = list(words) + ([END_ID] if n < max_length else [])
            scored.append((log_prob(model, f, sequence), list(words)))
    return sorted(scored, key=lambda s: -s[0])


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


def test_top_k_cannot_exceed_the_beam():
    with pytest.raises(ValueError, match="top_k"):
        beam_search(tiny_model(1), tf.zeros([1, 512]), beam_size=2, top_k=3)


def test_ids_to_text():
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "red", "circle"])
    assert ids_to_text(vocab, np.array([[[4, 5, 0], [5, 0, 0]]]), np.array([[2, 1]])) == [["red circle", "circle"]]
