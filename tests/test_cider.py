"""CIDEr-D in TensorFlow ops (captioning.train.cider) against CIDEr-D written here in plain Python from the
paper's definitions, and against pycocoevalcap's ``Cider``; on random captions and on real prepared
shapes records. No mocks."""

import collections
import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from pycocoevalcap.cider.cider import Cider

from captioning.data import schema
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.train.cider import (CiderD, DocumentFrequencies, caption_lengths, document_frequencies,
                                    frequencies_from_split, max_vocab_size, ngram_key, words_of)
from tests.helpers import REPO


# ---- CIDEr-D from the paper (Vedantam et al. 2015, §3 and CIDEr-D in §4): plain Python, no pycocoevalcap ----
def ngrams(words, k):
    return collections.Counter(tuple(words[i:i + k]) for i in range(len(words) - k + 1))


def paper_df(images):
    """n-gram → number of images (documents) with it in any reference."""
    return collections.Counter(gram for refs in images for gram in
                               {g for ref in refs for k in range(1, 5) for g in ngrams(ref, k)})


def paper_cider_d(candidate, refs, df, documents, sigma=6.0):
    """g_k(s) = h_k(s) · log(|I| / max(1, df)); CIDEr-D_n = 10/m Σ_j e^(-(l(c)-l(s_j))²/2σ²) ·
    Σ min(g(c), g(s_j))·g(s_j) / (‖g(c)‖ ‖g(s_j)‖); CIDEr-D = mean over n = 1..4. l() counts words, as in
    the paper (pycocoevalcap counts bigrams: the same delta whenever both have words, and an empty side
    scores 0 either way)."""
    def g(words, k):
        return {gram: h * math.log(documents / max(1, df[gram])) for gram, h in ngrams(words, k).items()}

    def norm(v):
        return math.sqrt(sum(x * x for x in v.values()))

    total = 0.0
    for ref in refs:
        similarity = 0.0
        for k in range(1, 5):
            gc, gs = g(candidate, k), g(ref, k)
            numerator = sum(min(w, gs.get(gram, 0.0)) * gs.get(gram, 0.0) for gram, w in gc.items())
            similarity += numerator / (norm(gc) * norm(gs)) if norm(gc) and norm(gs) else 0.0
        total += similarity / 4 * math.exp(-(len(candidate) - len(ref)) ** 2 / (2 * sigma ** 2))
    return 10.0 * total / len(refs) if refs else 0.0


def ragged(images):
    return tf.ragged.constant([[list(r) for r in refs] for refs in images], dtype=tf.int32, ragged_rank=2)


def padded(captions):
    width = max([len(c) for c in captions] + [0])
    return (np.array([list(c) + [0] * (width - len(c)) for c in captions], np.int32).reshape(len(captions), width),
            np.array([len(c) for c in captions], np.int32))


def tf_scores(scorer, candidates, images, image_index):
    ids, lengths = padded(candidates)
    return scorer.scores(ids, lengths, ragged(images), image_index=np.asarray(image_index, np.int32)).numpy()


def random_caption(rng, words, max_length=20):
    return tuple(rng.choice(words) for _ in range(rng.randint(0, max_length)))


def perturbed(rng, caption, words):
    caption = list(caption)
    for _ in range(rng.randint(0, 3)):
        op = rng.randrange(4)
        if op == 0 and caption:
            del caption[rng.randrange(len(caption))]
        elif op == 1:
            caption.insert(rng.randint(0, len(caption)), rng.choice(words))
        elif op == 2 and caption:
            caption[rng.randrange(len(caption))] = rng.choice(words)
        elif caption:
            caption = caption[:rng.randint(0, len(caption))]
    return tuple(caption)


# ---- random captions ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, vocab_size", [(0, 7), (1, 12), (2, 40)])
def test_random_captions_equal_the_paper_definition(seed, vocab_size):
    rng = random.Random(seed)
    words = list(range(3, vocab_size))  # <unk> (3) is a word like any other
    train = [[random_caption(rng, words) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    images = train[:12] + [[random_caption(rng, words) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    df = document_frequencies(train, vocab_size)
    expected_df = paper_df(train)
    assert df.keys.size == len(expected_df) and df.num_documents == 40
    assert all(df.count(gram) == count for gram, count in expected_df.items())
    candidates, index = [], []
    for i, refs in enumerate(images):
        for _ in range(4):
            source = rng.choice(refs) if rng.random() < 0.6 else random_caption(rng, words)
            candidates.append(perturbed(rng, source, words))
            index.append(i)
    candidates += [(), (words[0],), tuple(words[:3])]  # empty and shorter than n
    index += [0, 1, 2]
    got = tf_scores(CiderD(df), candidates, images, index)
    want = np.array([paper_cider_d(c, images[i], expected_df, 40) for c, i in zip(candidates, index)])
    assert np.abs(got - want).max() < 1e-6
    assert want.max() > 3.0 and (want == 0).sum() < len(want) // 2  # matches did happen
    assert got[-3] == 0.0


def test_an_image_without_references_scores_zero_and_references_may_be_one_per_candidate():
    df = document_frequencies([[(4, 5)], [(6,)]], vocab_size=8)
    scorer = CiderD(df)
    images = [[(4, 5), (4,)], [], [(6, 7)]]
    got = tf_scores(scorer, [(4, 5), (4, 5), (6, 7)], images, [0, 1, 2])
    assert got[1] == 0.0 and got[0] > 0 and got[2] > 0
    ids, lengths = padded([(4, 5), (4, 5), (6, 7)])
    np.testing.assert_array_equal(scorer.scores(ids, lengths, ragged(images)).numpy(), got)  # image_index=None


def test_the_scorer_compiles_once_for_any_shape_and_matches_eager_mode():
    rng = random.Random(3)
    words = list(range(3, 9))
    train = [[random_caption(rng, words) for _ in range(5)] for _ in range(20)]
    scorer = CiderD(document_frequencies(train, 9))
    fn = tf.function(scorer.scores, jit_compile=False, input_signature=[
        tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32),
        tf.RaggedTensorSpec([None, None, None], tf.int32, ragged_rank=2), tf.TensorSpec([None], tf.int32)],
        autograph=False)
    for images, samples in ((4, 3), (7, 5), (1, 1)):
        refs = train[:images]
        candidates = [random_caption(rng, words, 16) for _ in range(images * samples)]
        index = np.repeat(np.arange(images, dtype=np.int32), samples)
        ids, lengths = padded(candidates)
        eager = scorer.scores(ids, lengths, ragged(refs), image_index=index).numpy()
        np.testing.assert_allclose(fn(ids, lengths, ragged(refs), index).numpy(), eager, rtol=0, atol=1e-6)
        np.testing.assert_allclose(eager, [paper_cider_d(c, refs[i], paper_df(train), 20)
                                           for c, i in zip(candidates, index)], rtol=0, atol=1e-6)
    assert fn.experimental_get_tracing_count() == 1


MIRRORED = """
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from captioning.train.cider import CiderD, document_frequencies
images = json.loads(sys.argv[1])
ids, lengths, index = (tf.constant(x, tf.int32) for x in json.loads(sys.argv[2]))
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    scorer = CiderD(document_frequencies(images, 12))
refs = tf.ragged.constant(images, dtype=tf.int32, ragged_rank=2)
half = tf.shape(ids)[0] // 2

@tf.function(autograph=False)
def step():
    def replica():
        rows = tf.range(half) + half * tf.distribute.get_replica_context().replica_id_in_sync_group
        return scorer.scores(tf.gather(ids, rows), tf.gather(lengths, rows), refs, tf.gather(index, rows))
    return strategy.run(replica)

print(json.dumps(np.concatenate([t.numpy() for t in strategy.experimental_local_results(step())]).tolist()))
"""


@pytest.mark.slow
def test_the_scorer_runs_in_each_replica_of_a_mirrored_strategy():
    rng = random.Random(4)
    words = list(range(3, 12))
    images = [[list(random_caption(rng, words, 12)) for _ in range(3)] for _ in range(5)]
    candidates = [perturbed(rng, rng.choice(refs), words) for refs in images for _ in range(2)]
    ids, lengths = padded(candidates)
    index = [i for i in range(5) for _ in range(2)]
    out = subprocess.run([sys.executable, "-c", MIRRORED, json.dumps(images),
                          json.dumps([ids.tolist(), lengths.tolist(), index])],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = tf_scores(CiderD(document_frequencies(images, 12)), candidates, images, index)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert max(got) > 1.0


def test_sampled_ids_and_record_captions_helpers():
    ids = tf.constant([[5, 6, 2, 7], [0, 0, 0, 0], [4, 4, 4, 4]])
    np.testing.assert_array_equal(caption_lengths(ids).numpy(), [2, 0, 4])
    records = tf.ragged.constant([[[1, 4, 5, 2], [1, 2]], [[1, 6, 2]]])
    assert words_of(records).to_list() == [[[4, 5], []], [[6]]]


# ---- keys and the file ---------------------------------------------------------------------------------------
def test_ngram_keys_never_collide_across_orders():
    vocab = 6
    grams = [g for k in range(1, 5) for g in itertools.product(range(vocab), repeat=k)]
    keys = [ngram_key(g, vocab) for g in grams]
    assert len(set(keys)) == len(grams) == 6 + 36 + 216 + 1296
    assert keys == sorted(keys)  # by order, then lexicographically
    top = max_vocab_size(4)
    assert ngram_key([top - 1] * 4, top) == (top + 1) ** 4 - 1 <= 2 ** 63 - 1 < (top + 2) ** 4 - 1
    df = document_frequencies([[(top - 1, top - 1, top - 1, top - 1)]], top)
    assert df.keys.tolist() == sorted(ngram_key([top - 1] * k, top) for k in range(1, 5))
    with pytest.raises(InputError, match="at most 55107 words"):
        document_frequencies([[(4,)]], top + 1)


def test_references_must_be_words_of_the_vocabulary():
    with pytest.raises(InputError, match="words only"):
        document_frequencies([[(1, 4, 5, 2)]], 8)
    with pytest.raises(InputError, match=r"\[0, 8\)"):
        document_frequencies([[(4, 9)]], 8)


def test_save_and_load_round_trip(tmp_path):
    df = document_frequencies([[(4, 5, 6), (4,)], [(6, 7)]], 9, source="two images")
    path = str(tmp_path / "df.npz")
    df.save(path)
    assert os.listdir(tmp_path) == ["df.npz"]
    back = DocumentFrequencies.load(path)
    np.testing.assert_array_equal(back.keys, df.keys)
    np.testing.assert_array_equal(back.counts, df.counts)
    assert (back.num_documents, back.vocab_size, back.n, back.source) == (2, 9, 4, "two images")
    assert back.word_counts.size == 0 and back.share_longer(1) == 0  # not counted: unknown
    counted = dataclasses.replace(df, word_counts=np.array([0, 1, 1, 1]))  # references of 1, 2 and 3 words
    counted.save(path)
    assert list(DocumentFrequencies.load(path).word_counts) == [0, 1, 1, 1] and counted.share_longer(1) == 2 / 3


def test_a_damaged_or_foreign_file_is_one_line_naming_it(tmp_path):
    df = document_frequencies([[(4, 5, 6), (4,)], [(6, 7)]], 9)
    good = str(tmp_path / "df.npz")
    df.save(good)
    data = open(good, "rb").read()
    cases = {"cut.npz": data[: len(data) // 2], "noise.npz": os.urandom(500), "empty.npz": b"",
             "flipped.npz": data[:200] + bytes([data[200] ^ 0xFF]) + data[201:]}
    for name, content in cases.items():
        open(tmp_path / name, "wb").write(content)
    np.save(tmp_path / "array.npy", np.arange(3))
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    arrays = dict(np.load(good))
    np.savez(tmp_path / "version.npz", **{**arrays, "format_version": np.int64(99)})
    np.savez(tmp_path / "unsorted.npz", **{**arrays, "keys": arrays["keys"][::-1].copy()})
    np.savez(tmp_path / "objects.npz", **{**arrays, "keys": np.array([{"a": 1}], dtype=object)})
    for name in list(cases) + ["array.npy", "other.npz", "version.npz", "unsorted.npz", "objects.npz", "missing"]:
        path = str(tmp_path / name)
        with pytest.raises(InputError) as e:
            DocumentFrequencies.load(path)
        assert path in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


# ---- real prepared shapes records ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(prepared_dir):
    return prepared_dir  # conftest's: the shapes fixture, every word in the vocabulary


def split_references(data_dir, split):
    """Image id → its references as word-id tuples, read straight from the records."""
    out = {}
    for batch in tf.data.TFRecordDataset(PreparedDataset.load(data_dir).files(split)).batch(64).map(schema.parse_batch):
        for image_id, captions in zip(batch[schema.IMAGE_ID].numpy(), batch[schema.CAPTION_IDS].to_list()):
            assert all(c[0] == 1 and c[-1] == 2 for c in captions)
            out[int(image_id)] = [tuple(c[1:-1]) for c in captions]
    return out


def test_document_frequencies_of_a_prepared_split(data_dir):
    dataset = PreparedDataset.load(data_dir)
    df = frequencies_from_split(dataset, "train")
    train = list(split_references(data_dir, "train").values())
    expected = paper_df(train)
    assert (df.num_documents, df.vocab_size, df.keys.size) == (32, dataset.vocab_size, len(expected))
    assert all(df.count(gram) == count for gram, count in expected.items())
    assert df.source.endswith("train") and df.counts.max() <= 32
    lengths = [len(c) for image in train for c in image]  # words per reference: what scst.max_length must hold
    assert list(df.word_counts) == list(np.bincount(lengths)) and df.word_counts.sum() == 160
    longest = max(lengths)
    assert df.share_longer(longest) == 0 and df.share_longer(longest - 1) == lengths.count(longest) / 160


@pytest.mark.parametrize("split", ["test", "train"])
def test_equal_to_pycocoevalcap_cider_on_shapes(data_dir, split):
    rng = random.Random(5)
    references = split_references(data_dir, split)
    ids = sorted(references)
    images = [references[i] for i in ids]
    words = sorted({w for refs in images for r in refs for w in r})
    scorer = CiderD(document_frequencies(images, PreparedDataset.load(data_dir).vocab_size))  # as Cider counts
    candidate_sets = [[images[(j + 1) % len(images)][0] for j in range(len(images))],  # another image's
                      [perturbed(rng, rng.choice(refs), words) for refs in images],
                      [refs[-1] for refs in images], [()] + [refs[0][:1] for refs in images[1:]]]
    for candidates in candidate_sets:
        gts = {i: [" ".join(map(str, r)) for r in refs] for i, refs in zip(ids, images)}
        res = {i: [" ".join(map(str, c))] for i, c in zip(ids, candidates)}
        mean, per_image = Cider().compute_score(gts, res)
        got = tf_scores(scorer, candidates, images, range(len(images)))
        np.testing.assert_allclose(got, per_image, rtol=0, atol=1e-6)
        assert abs(got.mean() - mean) < 1e-6
    assert per_image[0] == 0.0  # the empty candidate


def test_training_frequencies_on_real_captions_equal_the_paper_definition(data_dir):
    rng = random.Random(6)
    df = frequencies_from_split(PreparedDataset.load(data_dir), "train")
    train = paper_df(split_references(data_dir, "train").values())
    images = list(split_references(data_dir, "test").values()) + list(split_references(data_dir, "val").values())
    words = sorted({w for refs in images for r in refs for w in r})
    candidates, index = [], []
    for i, refs in enumerate(images):
        for ref in refs:
            candidates += [ref, perturbed(rng, ref, words)]
            index += [i, i]
    got = tf_scores(CiderD(df), candidates, images, index)
    want = [paper_cider_d(c, images[i], train, 32) for c, i in zip(candidates, index)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert max(want) > 2.0
