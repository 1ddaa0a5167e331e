"""Tokenizers as a component (captioning/data/tokenizers): the words tokenizer (the prepared dataset's vocabulary)
and a keras-hub preset's own (tiny GPT-2 and Gemma presets written offline, tests/harness/lm_presets.py) under one
id rule, in a real tf.data pipeline over the shared prepared records, back to text, kept in a model folder, chosen
by data.tokenizer; and one caption string scoring the same whichever tokenizer wrote it."""

import collections
import dataclasses
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import load_config
from captioning.config.sections import DataConfig
from captioning.data.reading import references
from captioning.data.tokenizers import (OFFSET, TOKENIZERS, PresetTokenizer, WordsTokenizer, as_tokenizer, choose,
                                        load_tokenizer)
from captioning.errors import InputError
from captioning.vocab import END_ID, PAD_ID, START_ID, Vocabulary
from tests.helpers import small_train_config

PRESETS = ("gpt2", "gemma")
ODD = ["A  Red-Circle, LEFT of the BLUE square!", "", "two   big\tsquares ...", "it's 42 shapes_and dots"]
UNICODE = "Élan's ÜNÏCODE — 42 wörds"  # the tiny GPT-2's byte-level BPE lacks these bytes (a real one has all 256)


@pytest.fixture(scope="module")
def presets(lm_presets):
    """conftest's tiny GPT-2 and Gemma presets (written once a run)."""
    return lm_presets


@pytest.fixture(scope="module")
def tokenizers(presets, prepared_dir):
    from captioning.data.prepared import PreparedDataset

    made = {name: PresetTokenizer.from_preset(path) for name, path in presets.items()}
    made["words"] = WordsTokenizer.of(PreparedDataset.load(prepared_dir).vocabulary())
    return made


def plain(text: str) -> str:
    """The normalisation the tokenizers document, in Python: lowercase, runs of characters other than letters,
    digits and apostrophes one space, stripped."""
    return " ".join(re.sub(r"[^\w']|_", " ", text.lower()).split())


def lm_ids(tokenizer: PresetTokenizer, texts) -> list[list[int]]:
    """keras-hub's own TensorFlow tokenization of ``texts`` (no project code between)."""
    return tf.function(lambda t: tokenizer.lm.tokenize(t), autograph=False)(tf.constant(texts)).to_list()


def beam_format(ragged) -> tuple[np.ndarray, np.ndarray]:
    """caption_ids' ``[START, ids…, END]`` rows → beam search's ``ids [B, 1, T]`` (without START and END) and
    ``lengths [B, 1]``."""
    rows = [row[1:-1] for row in ragged.to_list()]
    ids = np.zeros((len(rows), 1, max(map(len, rows)) + 1), np.int32)
    for i, row in enumerate(rows):
        ids[i, 0, :len(row)] = row
    return ids, np.array([[len(row)] for row in rows], np.int32)


@pytest.mark.parametrize("name", PRESETS)
def test_a_real_pipeline_gives_the_presets_own_ids_plus_four_between_start_and_end(prepared_dir, tokenizers, name):
    """make_dataset over the prepared records with a preset's tokenizer: every caption of the split comes out once,
    as keras-hub's tokenize of its normalised text (GPT-2's after one space, so that its first word is ``Ġa`` as
    any other; Gemma's SentencePiece adds its own ``▁``) + 4, framed by START and END, in padded batches whose
    input and target ids are the caption shifted (the records' word ids are not read)."""
    from captioning.data.pipeline import make_dataset

    tokenizer = tokenizers[name]
    cfg = DataConfig(dir=prepared_dir, image_size=32, resize_size=36)
    texts = [plain(t) for captions in references(cfg, "val").values() for t in captions]
    spaced = [" " + t if name == "gpt2" else t for t in texts]
    expected = collections.Counter(tuple([START_ID] + [i + OFFSET for i in row] + [END_ID])
                                   for row in lm_ids(tokenizer, spaced))
    found = collections.Counter()
    for batch in make_dataset(cfg, "val", training=False, batch_size=4, tokenizer=tokenizer):
        for inputs, targets, mask in zip(batch["input_ids"].numpy(), batch["target_ids"].numpy(),
                                         batch["mask"].numpy()):
            n = int(mask.sum())
            assert list(inputs[1:n]) == list(targets[:n - 1]) and set(inputs[n:]) <= {PAD_ID}
            found[tuple([int(inputs[0])] + [int(t) for t in targets[:n]])] += 1
    assert found == expected and sum(found.values()) == len(texts) == 20
    words = make_dataset(cfg, "val", training=False, batch_size=4, tokenizer=tokenizers["words"])
    assert max(int(b["target_ids"].numpy().max()) for b in words) < len(tokenizers["words"])  # the records' ids


@pytest.mark.parametrize("name", ("words",) + PRESETS)
def test_detokenize_inverts_caption_ids_and_the_pieces_spell_each_word(prepared_dir, tokenizers, name):
    """caption_ids then detokenize (TensorFlow), decode and text (Python) give the normalised caption back (the words
    tokenizer: a word it lacks as <unk>); a preset's agrees with keras-hub's own detokenize; the pieces of a caption's
    ids, grouped where starts_word says a word begins, are its words; reserved and special ids spell nothing."""
    tokenizer = tokenizers[name]
    cfg = DataConfig(dir=prepared_dir)
    texts = [t for captions in references(cfg, "test").values() for t in captions] + ODD
    texts += [UNICODE] if name != "gpt2" else []
    ragged = tokenizer.caption_ids(tf.constant(texts))
    assert ragged.dtype == tf.int64 and all(r[0] == START_ID and r[-1] == END_ID for r in ragged.to_list())
    known = set(tokenizers["words"].words)
    wanted = [plain(t) if name != "words" else " ".join(w if w in known else "<unk>" for w in plain(t).split())
              for t in texts]
    ids, lengths = beam_format(ragged)
    after_end = np.concatenate([ids[:, 0], np.full((len(texts), 2), END_ID), ids[:, 0, :2]], axis=1)  # stops at END
    assert [t.decode() for t in tokenizer.detokenize(tf.constant(after_end)).numpy()] == wanted
    assert [tokenizer.text(row[1:-1]) for row in ragged.to_list()] == wanted
    assert [" ".join(tokenizer.decode(row[1:])) for row in ragged.to_list()] == wanted
    pieces, starts = tokenizer.pieces(), tokenizer.starts_word()
    assert len(pieces) == len(starts) == len(tokenizer) and pieces[:4] == [""] * 4 and not starts[:4].any()
    assert all(pieces[i] == "" and not starts[i] for i in tokenizer.special_ids())
    for row, text in zip(ragged.to_list(), wanted):
        spelt = []
        for i in row[1:-1]:
            if starts[i] or not spelt:
                spelt.append(b"")
            spelt[-1] += pieces[i] if isinstance(pieces[i], bytes) else pieces[i].encode()  # bytes: part of a character
        assert [w.decode().strip() for w in spelt if w] == [w for w in text.split() if w != "<unk>"]  # reserved: none
    if name != "words":
        own = tf.ragged.constant([[i - OFFSET for i in r[1:-1]] for r in ragged.to_list()], tf.int32)
        lm = tf.function(tokenizer.lm.detokenize, autograph=False)(own)  # keras-hub's TensorFlow path
        assert [" ".join(t.decode().split()) for t in lm.numpy()] == wanted
        assert len(tokenizer) == OFFSET + tokenizer.lm.vocabulary_size()
        assert tokenizer.lm_end_id + OFFSET in tokenizer.special_ids()


def test_the_id_rule_of_each_preset(tokenizers):
    """GPT-2's one special token (<|endoftext|>, its start, end and padding) is project id 4; Gemma's <pad>, <eos>,
    <bos> and <unk> are 4-7 and its words take several pieces (``red`` is ``▁ re d``), each word's first piece
    starting it; a GPT-2 word it knows is one space-led piece."""
    gpt2, gemma = tokenizers["gpt2"], tokenizers["gemma"]
    assert gpt2.special_ids() == (4,) and gemma.special_ids() == (4, 5, 6, 7)
    ids = gemma.caption_ids(tf.constant(["red"])).to_list()[0][1:-1]
    assert [gemma.pieces()[i] for i in ids] == [" ", "re", "d"] and list(gemma.starts_word()[ids]) == [1, 0, 0]
    ids = gpt2.caption_ids(tf.constant(["a red"])).to_list()[0][1:-1]
    assert [gpt2.pieces()[i] for i in ids] == [" a", " red"] and gpt2.starts_word()[ids].all()


@pytest.mark.parametrize("name", ("words",) + PRESETS)
def test_a_model_folder_keeps_its_tokenizer(tmp_path, prepared_dir, tokenizers, name):
    """save_to into a model folder and load_tokenizer back: equal, the same ids for the same texts; the words
    tokenizer is vocab.txt as it always was, a preset's a tokenizer/ folder that needs nothing of its preset; a
    folder made with one tokenizer refuses another in one line."""
    from captioning.model.folder import ModelDir

    tokenizer = tokenizers[name]
    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer.save_to(str(folder))
    back = load_tokenizer(str(folder))
    assert type(back) is type(tokenizer) and back == tokenizer and back.identity == tokenizer.identity
    texts = tf.constant(ODD)
    assert back.caption_ids(texts).to_list() == tokenizer.caption_ids(texts).to_list()
    if name == "words":
        assert os.listdir(folder) == ["vocab.txt"] and Vocabulary.load(str(folder / "vocab.txt")) == tokenizer
    else:
        assert os.listdir(folder) == ["tokenizer"] and not os.path.exists(folder / "vocab.txt")
    assert ModelDir(str(folder)).read_vocab() == tokenizer
    other = tokenizers["gemma" if name == "gpt2" else "gpt2"]
    assert other != tokenizer and as_tokenizer(tokenizer) is tokenizer
    cfg = small_train_config(prepared_dir)
    with pytest.raises(InputError, match="another tokenizer|another vocabulary") as info:
        ModelDir(str(folder)).check_fits(cfg, other)
    assert "\n" not in str(info.value)


def test_data_tokenizer_resolves_against_the_decoder_and_refuses_what_it_cannot_read(prepared_dir, presets,
                                                                                     monkeypatch):
    """auto is the decoder's own (words for Show and Tell; the preset's for a decoder that declares one), preset
    without a preset and words with one are refused in one line, an unknown value by the config; the experiment
    makes the tokenizer once, and a features store (word ids only) cannot feed a preset's."""
    from captioning.experiment import for_training
    from captioning.model import DECODERS
    from captioning.model.show_and_tell import ShowAndTell

    assert set(TOKENIZERS) == {"words", "preset"}
    assert choose("auto", None, "attention") == "words" and choose("auto", "dir", "x") == "preset"
    experiment = for_training(small_train_config(prepared_dir))
    assert experiment.tokenizer_kind == "words" and experiment.tokenizer == experiment.dataset.vocabulary()
    assert experiment.tokenizer is experiment.tokenizer  # made once
    with pytest.raises(InputError, match=r"^data.tokenizer: preset needs a decoder that reads a language model's "
                                         r"preset; model.decoder show_and_tell writes"):
        for_training(small_train_config(prepared_dir, "data.tokenizer=preset"))
    with pytest.raises(InputError, match="data.tokenizer must be one of auto, words, preset"):
        load_config(None, ["data.tokenizer=bpe"])

    class OverGpt2(ShowAndTell):  # a decoder that reads a preset's tokenizer (prefix_lm's declaration)
        @classmethod
        def tokenizer_preset(cls, settings):
            return presets["gpt2"]

    monkeypatch.setitem(DECODERS, "over_gpt2", OverGpt2)
    experiment = for_training(small_train_config(prepared_dir, "model.decoder=over_gpt2"))
    assert experiment.tokenizer_kind == "preset" and experiment.tokenizer == PresetTokenizer.from_preset(presets["gpt2"])
    with pytest.raises(InputError, match=r"^data.tokenizer: words cannot feed model.decoder over_gpt2, which writes "
                                         r"captions in its preset's tokenizer"):
        for_training(small_train_config(prepared_dir, "model.decoder=over_gpt2", "data.tokenizer=words"))


def written_by_each(shapes_dir, prepared_dir, tokenizers):
    """The test split's second captions (and each first caption's words reversed) written as ids by the words
    tokenizer, GPT-2's and Gemma's, and read back as evaluate reads a model's (ids_to_text): tokenizer name →
    (image id → best caption, image id → its two captions); the references; the training captions; the
    normalised captions."""
    from captioning.model.decode import ids_to_text

    cfg = DataConfig(dir=prepared_dir)
    refs = references(cfg, "test")
    train = [t for captions in references(cfg, "train").values() for t in captions]
    images = sorted(refs)
    captions = [refs[i][1] for i in images] + [" ".join(reversed(refs[i][0].split())) for i in images]
    written = {}
    for name, tokenizer in tokenizers.items():
        ids, lengths = beam_format(tokenizer.caption_ids(tf.constant(captions)))
        texts = [t[0] for t in ids_to_text(tokenizer, ids, lengths)]
        best, second = dict(zip(images, texts)), dict(zip(images, texts[len(images):]))
        written[name] = best, {i: [best[i], second[i]] for i in images}
    return written, refs, train, [plain(c) for c in captions]


def test_one_caption_scores_the_same_whichever_tokenizer_wrote_it(shapes_dir, prepared_dir, tokenizers):
    """The same caption strings come back from each tokenizer's ids, and CHAIR (on the shapes' instances) and
    diversity score them the same."""
    from captioning.evaluation import hallucination
    from captioning.evaluation.diversity import diversity

    written, refs, train, captions = written_by_each(shapes_dir, prepared_dir, tokenizers)
    objects = hallucination.load_objects(os.path.join(shapes_dir, "annotations", "instances_test.json"))
    scored = {name: (best, every, hallucination.chair(objects, best).to_result("x"),
                     diversity(every, len(tokenizers["words"]), train)) for name, (best, every) in written.items()}
    assert list(scored["words"][0].values()) + [c[1] for c in scored["words"][1].values()] == captions
    assert scored["gpt2"] == scored["words"] == scored["gemma"]
    assert scored["words"][2]["hallucination"]["mentions"] > 0 and scored["words"][3]["words_used"] > 3


@pytest.mark.slow
def test_one_caption_gets_the_same_coco_metrics_whichever_tokenizer_wrote_it(shapes_dir, prepared_dir, tokenizers):
    """BLEU, METEOR, ROUGE-L and CIDEr (pycocoevalcap, through Java) of the captions each tokenizer wrote: the same."""
    from captioning.evaluation import metrics

    written, refs, _, _ = written_by_each(shapes_dir, prepared_dir, tokenizers)
    scores = {name: metrics.coco_metrics(refs, best) for name, (best, _) in written.items()}
    assert scores["gpt2"] == scores["words"] == scores["gemma"] and scores["words"]["CIDEr"] > 0


def test_a_model_folder_of_format_9_read_the_word_vocabulary(tmp_path):
    """data.tokenizer came with format 10: an older config.yaml without it loads as words (what it read), and one of
    the current format without it is damage."""
    import yaml

    from captioning.config import to_dict
    from captioning.config.migrations import FORMAT_VERSION

    saved = os.path.join(os.path.dirname(__file__), "data", "model_folders_v1", "show_and_tell.config.yaml")
    data = to_dict(load_config(saved, complete=True))
    del data["data"]["tokenizer"]
    old, now = tmp_path / "old.yaml", tmp_path / "now.yaml"
    old.write_text(yaml.safe_dump({"format_version": 9, **data}))
    now.write_text(yaml.safe_dump({"format_version": FORMAT_VERSION, **data}))
    assert load_config(str(old), complete=True).data.tokenizer == "words"
    with pytest.raises(InputError, match="lacks 1 of its keys"):
        load_config(str(now), complete=True)


@pytest.mark.slow
def test_a_decoder_over_a_presets_tokenizer_trains_keeps_it_and_captions_with_it(prepared_dir, shapes_dir, presets,
                                                                                  tokenizers, tmp_path):
    """End to end with prefix_lm over GPT-2's preset, its LM frozen, ``data.tokenizer: preset`` (the captions
    tokenized in the pipeline by the preset's tokenizer): 3 training steps train the mapper, and the model folder's
    LM weights stay bit for bit the preset's; the folder keeps tokenizer/ and no vocab.txt, it loads with that
    tokenizer (of 4 + 247 ids), captions images as detokenized text, evaluate scores it (the loss over the records'
    text tokenized, CHAIR, diversity), and a second run with the words tokenizer is refused; the same pipeline runs
    on a tf.data service worker process (which loads TensorFlow Text's ops). (tests/test_prefix_lm.py: the decoder
    itself.)"""
    import keras_hub

    from captioning.config import DecodeConfig
    from captioning.data.pipeline import make_dataset
    from captioning.evaluation.evaluate import evaluate
    from captioning.experiment import for_training
    from captioning.inference.captioner import Captioner
    from captioning.model.folder import ModelDir
    from captioning.train import Trainer
    from tests.harness.data_service import Cluster

    model_dir = str(tmp_path / "model")
    cfg = small_train_config(prepared_dir, "model.decoder=prefix_lm", f"model.decoder_preset={presets['gpt2']}",
                             "model.mapper=mlp", "model.prefix_length=2", "data.tokenizer=preset", "train.steps=3",
                             "train.optimizer=adam", "train.learning_rate=0.01")
    trainer = Trainer(for_training(cfg), model_dir)
    assert trainer.model.vocab_size == 251
    mapper_before = [v.numpy().copy() for v in trainer.model.mapper.weights]
    assert trainer.run(progress=False).step == 3
    assert "tokenizer" in os.listdir(model_dir) and "vocab.txt" not in os.listdir(model_dir)
    trained = ModelDir(model_dir).load()
    assert trained.step == 3
    assert trained.vocab == tokenizers["gpt2"] and trained.model.vocab_size == 251 == len(trained.vocab)
    original = keras_hub.models.Backbone.from_preset(presets["gpt2"])
    assert len(trained.model.backbone.weights) == len(original.weights) > 20
    for a, b in zip(trained.model.backbone.weights, original.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert any(not np.array_equal(v.numpy(), b) for v, b in zip(trained.model.mapper.weights, mapper_before))
    images = os.path.join(shapes_dir, "images")
    encoded = [open(os.path.join(images, f), "rb").read() for f in sorted(os.listdir(images))[:2]]
    captions = Captioner(trained, DecodeConfig(beam_size=2, max_length=5)).caption(encoded)
    assert len(captions) == 2
    for caption in captions:  # GPT-2's pieces detokenized, its special token never written
        assert isinstance(caption[0].text, str) and "<" not in caption[0].text
    result = evaluate(model_dir, split="test", beam_size=1, max_images=2, progress=False,
                      instances=os.path.join(shapes_dir, "annotations", "instances_test.json"))
    assert result.num_images == 2 and np.isfinite(result.loss) and result["diversity"]["words_used"] >= 0
    predictions = [p for p in os.listdir(os.path.join(model_dir, "eval")) if p.endswith(".predictions.json")]
    assert len(predictions) == 1  # the detokenized captions, scored as words
    words = small_train_config(prepared_dir, "train.steps=3")
    with pytest.raises(InputError, match="another tokenizer"):
        Trainer(for_training(words), model_dir)

    cluster = Cluster(tmp_path / "service", workers=1)
    try:
        served = load_config(None, [f"data.dir={prepared_dir}", "data.image_size=32", "data.resize_size=36",
                                    f"data.service={cluster.service}", "data.service_mode=distributed_epoch"]).data
        ds = make_dataset(served, "val", training=True, batch_size=4, repeat=False, service_job="tokenized",
                          tokenizer=tokenizers["gpt2"])
        found = sorted(tuple(int(t) for t in row[:int(m.sum())]) for b in ds.as_numpy_iterator()
                       for row, m in zip(b["target_ids"], b["mask"]))
        local = make_dataset(dataclasses.replace(served, service=""), "val", training=False, batch_size=4,
                             tokenizer=tokenizers["gpt2"])
        assert found and set(found) <= {tuple(int(t) for t in row[:int(m.sum())]) for b in local.as_numpy_iterator()
                                        for row, m in zip(b["target_ids"], b["mask"])}
    finally:
        cluster.close()


def test_a_cache_of_tokenized_captions_is_keyed_by_its_tokenizer(tmp_path, tokenizers):
    """data.cache: disk and features hold the captions' ids: a preset's tokenizer joins their key (another
    tokenizer, another file), the words tokenizer leaves the key as it always was (caches written before stay
    valid)."""
    from captioning.data import disk_cache

    args = (str(tmp_path), "dataset-id", "train", 36, False)
    words, _ = disk_cache.cache_prefix(*args)
    gpt2, key = disk_cache.cache_prefix(*args, tokenizer=tokenizers["gpt2"].identity)
    gemma, _ = disk_cache.cache_prefix(*args, tokenizer=tokenizers["gemma"].identity)
    assert len({words, gpt2, gemma}) == 3 and key["tokenizer"] == tokenizers["gpt2"].identity
    assert os.path.basename(words) == "train-5a5ea984d4d91f4b-0of1"  # the name a words cache always had


def test_a_features_store_cannot_feed_a_presets_tokenizer(region_data, presets, tokenizers, monkeypatch):
    """A features store's records hold word ids only: a run reading regions with a preset's tokenizer is refused in
    one line before it starts, and the input pipeline refuses it too."""
    from captioning.data.pipeline import make_dataset
    from captioning.experiment import for_training
    from captioning.model import DECODERS
    from captioning.model.data_sources import data_source
    from captioning.model.show_and_tell import ShowAndTell

    class OverGpt2(ShowAndTell):
        @classmethod
        def tokenizer_preset(cls, settings):
            return presets["gpt2"]

    monkeypatch.setitem(DECODERS, "over_gpt2", OverGpt2)
    cfg = small_train_config(region_data[0], "data.features=regions", "data.features_store=oracle",
                             "model.decoder=over_gpt2")
    with pytest.raises(InputError, match=r"^data.tokenizer: preset tokenizes the records' caption text, and a "
                                         r"features store holds only word ids \(data.features: regions\)"):
        for_training(cfg)
    with pytest.raises(InputError, match="data.tokenizer preset needs data.features: images"):
        make_dataset(cfg.data, "train", training=True, batch_size=4, source=data_source(cfg),
                     tokenizer=tokenizers["gpt2"])


def test_a_tokenizers_tables_first_made_inside_a_trace_serve_every_later_call(prepared_dir, presets):
    """The lookup tables and constants a tokenizer makes on first use are eager ones, even when that first use is
    inside a traced function (a tf.data map, the captioner's search): later calls, eager or in another graph, read
    them (a table made in the first trace's graph would be out of reach)."""
    from captioning.data.prepared import PreparedDataset

    for tokenizer in (WordsTokenizer.of(Vocabulary(PreparedDataset.load(prepared_dir).vocabulary().words)),
                      PresetTokenizer.from_preset(presets["gemma"])):
        ids = tf.function(lambda t: tokenizer.caption_ids(t).to_tensor(), autograph=False)(tf.constant(["a red circle"]))
        assert tokenizer.caption_ids(tf.constant(["a red circle"])).to_tensor().numpy().tolist() == ids.numpy().tolist()
        for call in (tf.function(tokenizer.detokenize, autograph=False), tokenizer.detokenize,
                     tf.function(tokenizer.detokenize, autograph=False)):
            assert call(ids[:, 1:]).numpy().tolist() == [b"a red circle"]


def test_lm_trains_read_text_normalised_as_the_pipeline_normalises_a_caption():
    """`lm train`'s text (data_prep.lm_text.normalize, Python, no TensorFlow) and the preset tokenizer's captions
    (tokenizers.base.normalized, in the graph) are one rule: the LM learns the text it is later fed."""
    from captioning.data.tokenizers.base import normalized
    from data_prep.lm_text import normalize

    texts = ["  A red-ish CIRCLE, isn't it?  ", "Ünïcode ÉTÉ -- café-au-lait", "snake_case and_more", "tabs\tand\nlines",
             "x² ½ 3.5", "日本語 テキスト。", "İstanbul ΣΊΣΥΦΟΣ", "", "!!!", "o'clock ''quoted''"]
    graph = [t.decode("utf-8") for t in normalized(tf.constant(texts)).numpy()]
    assert graph == [normalize(t) for t in texts]


def test_tokenizers_that_tokenize_alike_share_one_traced_tokenization(presets, tokenizers):
    """A byte-pair preset's tokenizer loaded again (an ensemble's members, a model folder read twice) calls the
    function the first one traced (no second trace of keras-hub's tokenizer, 1.5-2.7 CPU s) and gives the same ids;
    a tokenizer of the same pieces with other keras-hub settings (a sequence_length), of another preset, or of
    SentencePiece (one op, cheap to trace) traces its own."""
    import keras_hub

    first, again = tokenizers["gpt2"], PresetTokenizer.from_preset(presets["gpt2"])
    texts = tf.constant(["a red circle", "", "two big squares"])
    assert again.caption_ids(texts).to_list() == first.caption_ids(texts).to_list()
    assert again._traced is first._traced
    gemma, gemma_again = (PresetTokenizer.from_preset(presets["gemma"]) for _ in range(2))
    assert gemma_again.caption_ids(texts).to_list() == gemma.caption_ids(texts).to_list()
    assert gemma._traced is not first._traced and gemma_again._traced is not gemma._traced
    padded = PresetTokenizer(keras_hub.tokenizers.Tokenizer.from_preset(presets["gpt2"]), "padded")
    padded.lm.sequence_length = 8
    assert padded.identity == first.identity  # the same pieces: only the settings tell them apart
    with pytest.raises(ValueError, match="padded's tokenizer gives padded sequences"):
        padded.caption_ids(texts)


def test_a_sentencepiece_tokenizer_outlives_tensorflow_forgetting_its_eager_kernels(presets, tokenizers):
    """TensorFlow drops the kernels it ran eagerly whenever the global seed is set (``keras.utils.set_random_seed``:
    a Trainer does it after ``for_training`` made the run's tokenizer; a second run or model in one process),
    and TensorFlow Text's SentencePiece model was such a kernel's own resource, made when keras-hub loaded the
    tokenizer: every Gemma tokenizer of the process then failed (NotFoundError: its resource does not exist). A
    Gemma tokenizer made before, traced before or not, tokenizes after, eagerly and in a tf.data map."""
    fresh = PresetTokenizer.from_preset(presets["gemma"])  # never traced
    texts = ["a red circle", "two big squares"]
    expected = [[START_ID] + [i + OFFSET for i in row] + [END_ID] for row in lm_ids(tokenizers["gemma"], texts)]
    assert tokenizers["gemma"].caption_ids(tf.constant(texts)).to_list() == expected
    try:
        tf.random.set_seed(0)  # (what keras.utils.set_random_seed does to TensorFlow)
        for tokenizer in (tokenizers["gemma"], fresh):
            assert tokenizer.caption_ids(tf.constant(texts)).to_list() == expected
            mapped = tf.data.Dataset.from_tensor_slices(texts).batch(2).map(tokenizer.caption_ids)
            assert [row for batch in mapped for row in batch.to_list()] == expected
    finally:
        tf.random.set_seed(None)  # no global seed, as before (which again drops the kernels)
