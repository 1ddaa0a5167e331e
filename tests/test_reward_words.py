"""SCST's CIDEr-D reward on words whatever the tokenizer (captioning.train.reward_words with the SCST objective's
score and references): a caption string scores the same written in the word vocabulary's ids and in the tiny GPT-2's
and Gemma's pieces, and the reward is pycocoevalcap's CIDEr-D of the words, unknown words included."""

import numpy as np
import pytest
import tensorflow as tf
from pycocoevalcap.cider.cider import Cider

from captioning.data.tokenizers import PresetTokenizer, WordsTokenizer
from captioning.train.cider import CiderD, document_frequencies, rebased, ngram_key
from captioning.train.objectives.scst import ScstSettings, SelfCritical
from captioning.train.reward_words import RewardWords
from captioning.vocab import END_ID, RESERVED, Vocabulary

REFERENCES = [  # per image; every word is a scene word (whole GPT-2 pieces, several Gemma pieces)
    ["a red circle above a blue square", "a red circle", "two shapes"],
    ["a small green triangle left of a large circle", "a green triangle and a circle"],
    ["three white squares", "the squares are white", "three squares on the left"],
    ["a purple shape", "one purple circle next to a yellow triangle"],
]
CANDIDATES = [  # per image: its own reference, a changed one, another image's, a repeated word, short, empty
    ["a red circle above a blue square", "a red circle below a blue square", "three white squares", "circle circle",
     "a", ""],
    ["a small green triangle", "a green triangle and a circle", "the squares are white", "a a triangle", "green",
     "a large circle left of a small green triangle"],
    ["three white squares", "white squares", "a purple shape", "squares squares squares", "the", "three"],
    ["a purple circle", "one purple circle next to a yellow triangle", "two shapes", "purple purple", "a shape",
     "shape"],
]
UNKNOWN = [  # words the vocabulary lacks: each a word of its own, the same word the same
    "a red zebra above a blue zebra", "a qux triangle and a zebra circle", "zebra qux zebra", "xyzzy"]
MAX_PIECES = 24


@pytest.fixture(scope="module")
def tokenizers(lm_presets):
    """A word vocabulary of the references' words, and the session's tiny presets' tokenizers (``lm_presets``)."""
    words = sorted({w for refs in REFERENCES for r in refs for w in r.split()} | {"below", "large"})
    out = {"words": WordsTokenizer.of(Vocabulary(RESERVED + tuple(words)))}
    for name, folder in lm_presets.items():
        out[name] = PresetTokenizer.from_preset(folder)
    return out


def drawn(tokenizer, texts):
    """Captions as SCST's sampling draws them: pieces, then <end>, then <pad> ``[N, MAX_PIECES]``."""
    ids = tokenizer.caption_ids(tf.constant(texts))[:, 1:]  # [START, pieces…, END] → pieces…, END
    return tf.cast(ids.to_tensor(0, shape=[len(texts), MAX_PIECES]), tf.int32)


def grouped_batch(tokenizer):
    """A grouped batch of the four images' references as the pipeline gives them: target ids and mask."""
    texts = [text for refs in REFERENCES for text in refs]
    targets = drawn(tokenizer, texts)
    index = [i for i, refs in enumerate(REFERENCES) for _ in refs]
    return {"target_ids": targets, "mask": tf.cast(targets > 0, tf.float32), "image_index": tf.constant(index),
            "features": tf.zeros([len(REFERENCES), 1])}


def objective(tokenizers, name, end_in_reward):
    """The SCST objective of a run whose tokenizer is ``name``, with the document frequencies of the word
    vocabulary's references (the four images'), as a run counts them from the records."""
    vocab = tokenizers["words"]
    references = [[vocab.encode(r.split())[1:-1] + ([END_ID] if end_in_reward else []) for r in refs]
                  for refs in REFERENCES]
    frequencies = document_frequencies(references, len(vocab), end_token=end_in_reward)
    words = None if name == "words" else RewardWords(tokenizers[name], vocab.words, MAX_PIECES)
    return SelfCritical(CiderD(frequencies, extra_ids=words.extra if words else 0),
                        ScstSettings(end_in_reward=end_in_reward), tf.Variable(0), words=words)


_SCORES = {}  # (tokenizers, name, end_in_reward) → the objective's score, traced once per input shape


def rewards(tokenizers, name, texts, end_in_reward, index):
    key = (id(tokenizers), name, end_in_reward)
    if key not in _SCORES:
        scst = objective(tokenizers, name, end_in_reward)
        _SCORES[key] = tf.function(lambda ids, batch, index: scst.score(ids, scst.references(batch), index)["reward"],
                                   autograph=False)
    tokenizer = tokenizers[name]
    return _SCORES[key](drawn(tokenizer, texts), grouped_batch(tokenizer), index).numpy()


@pytest.mark.parametrize("end_in_reward", [True, False])
def test_a_caption_string_scores_the_same_whichever_tokenizer_wrote_it(tokenizers, end_in_reward):
    texts = [text for image in CANDIDATES for text in image]
    index = tf.constant([i for i, image in enumerate(CANDIDATES) for _ in image])
    by_words = rewards(tokenizers, "words", texts, end_in_reward, index)
    assert by_words.max() > 5.0 and (by_words == 0).sum() >= 1  # the references themselves score high
    for name in ("gpt2", "gemma"):
        np.testing.assert_allclose(rewards(tokenizers, name, texts, end_in_reward, index), by_words, rtol=0,
                                   atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", ["gpt2", "gemma"])
def test_the_reward_of_pieces_is_pycocoevalcaps_cider_d_of_the_words(tokenizers, name):
    """Pieces (words the vocabulary lacks among them) scored against the references' pieces equal pycocoevalcap's
    Cider on the words (which counts document frequencies over the references it is given), without <end>."""
    ids = list(range(len(REFERENCES)))
    gts = {i: refs for i, refs in zip(ids, REFERENCES)}
    for candidates in [[image[k] for image in CANDIDATES] for k in (1, 3)] + [UNKNOWN]:
        want = Cider().compute_score(gts, {i: [c] for i, c in zip(ids, candidates)})[1]
        got = rewards(tokenizers, name, candidates, False, tf.range(len(REFERENCES)))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert got[:2].min() > 0.0  # the unknown words' captions still score their known words


def test_unknown_words_get_fresh_ids_and_the_frequencies_new_keys(tokenizers):
    """A candidate's unknown words are ids from the vocabulary's size on, the same word the same id, distinct words
    distinct ids (never <unk>); a reference's unknown word is <unk>. The document frequencies' keys are rewritten in
    the larger base."""
    vocab = tokenizers["words"]
    words = RewardWords(tokenizers["gemma"], vocab.words, 4)
    ids, lengths = words.candidates(drawn(tokenizers["gemma"], ["zebra a qux zebra red", "a red"]), True)
    v = len(vocab)
    assert ids.numpy().tolist()[0][:6] == [v, vocab.id("a"), v + 1, v, vocab.id("red"), END_ID]
    assert lengths.numpy().tolist() == [6, 3]
    refs = words.references(tf.RaggedTensor.from_row_lengths(
        tf.RaggedTensor.from_tensor(drawn(tokenizers["gemma"], ["a zebra", "red"])), [2]), False)
    assert refs.to_list() == [[[vocab.id("a"), 3], [vocab.id("red")]]]
    for empty in (tf.fill([2, 5], END_ID), tf.zeros([0, 5], tf.int32)):  # captions of no word; no caption
        ids, lengths = words.candidates(empty, True)
        assert lengths.numpy().tolist() == [1] * empty.shape[0] and (ids.numpy()[:, 0] == END_ID).all()
    assert rebased(np.array([ngram_key([4, 5, 6], v)]), v + 1, v + 5, 3).tolist() == [ngram_key([4, 5, 6], v + 4)]


def test_a_sample_captions_note_scores_its_pieces_against_the_records_words(tokenizers):
    """The reward noted beside a greedy sample caption (SelfCritical.rewards_of: the best caption against the
    records' word ids) is the same for the caption's words and its pieces."""
    vocab = tokenizers["words"]
    captions = tf.ragged.constant([[vocab.encode(r.split()) for r in refs] for refs in REFERENCES])
    texts = [image[1] for image in CANDIDATES]
    got = {}
    for name, tokenizer in tokenizers.items():
        ids = drawn(tokenizer, texts)
        words = tf.where(tf.equal(ids, END_ID), 0, ids)
        best = {"ids": words[:, None], "lengths": tf.reduce_sum(tf.cast(words > 0, tf.int32), axis=1)[:, None]}
        got[name] = objective(tokenizers, name, True).rewards_of(best, captions)
    assert got["words"].min() > 1.0
    for name in ("gpt2", "gemma"):
        np.testing.assert_allclose(got[name], got["words"], rtol=0, atol=1e-6, err_msg=name)
