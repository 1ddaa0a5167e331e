"""``model.decoder: prefix_lm`` with the rest of the project (issue 50, item 3): ensembles of prefix-LM models of one
tokenizer (and the one-line refusal of models whose tokenizers differ), SCST from a cross-entropy prefix_lm
checkpoint (the reward on the detokenized words), every decoding option over the pieces, the weight average and
gradient accumulation with a frozen LM (which stays bit-identical). The 2-replica step of prefix_lm is the decoder
contract's (tests/test_decoders.py, fine-tuned) and its SCST step the distributed scenario ``mirrored_scst_plm``
(frozen LM; tests/distributed_worker.py)."""

import dataclasses
import json
import math
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests.harness.scenarios import GROUPED, grouped_batches, joined
from tests.helpers import copies, encode, gradient, run_cli, small_train_config


def plm(preset, *extra):
    """The fixture's prefix_lm settings over ``preset`` (ClipCap's MLP into 2 prefix vectors)."""
    return ("model.decoder=prefix_lm", f"model.decoder_preset={preset}", "model.mapper=mlp", "model.prefix_length=2",
            *extra)


def trained_words(prepared_dir):
    with open(os.path.join(prepared_dir, "vocab.txt"), encoding="utf-8") as f:
        return f.read().splitlines()


def photos(tmp_path, count=3):
    out = []
    for i, size in enumerate([(48, 40), (64, 64), (30, 50)][:count]):
        path = tmp_path / f"p{i}.png"
        path.write_bytes(encode(gradient(size=size).rotate(40 * i), "PNG"))
        out.append(str(path))
    return out


@pytest.mark.slow
def test_a_prefix_lm_over_a_gemma_preset_trains_and_captions(prepared_dir, lm_presets, tmp_path):
    """prefix_lm over the tiny Gemma preset (SentencePiece pieces, data.tokenizer auto): the run's tokenizer is made
    before the Trainer sets the global seed, which makes TensorFlow drop its eager kernels (the SentencePiece model's
    resource was one's own until 0d4e15c, and this run's first batch failed); 2 steps, then a caption in its pieces."""
    from captioning import inference
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, *plm(lm_presets["gemma"]), "train.steps=2",
                             "train.checkpoint_every_steps=2")
    record = Trainer(for_training(cfg), str(tmp_path / "m")).run(progress=False)
    assert record.step == 2
    trained = inference.load(str(tmp_path / "m"))
    assert trained.vocab.kind == "preset" and trained.vocab.lm.__class__.__name__ == "GemmaTokenizer"
    [[best, *_]] = inference.Captioner(trained).caption([encode(gradient(size=(40, 40)), "PNG")])
    assert isinstance(best.text, str) and math.isfinite(best.log_prob) and best.log_prob <= 0


# ------------------------------------------------------------------------------------------------ ensembles


def ensemble_log_probs(members, crops, ids, lengths, max_length):
    """Each caption's summed log of the members' averaged probabilities (its pieces, then <end> when it ended
    before ``max_length``), from each member alone stepped over the captions (:func:`stepped`)."""
    from captioning.vocab import END_ID

    rows = [[int(i) for i in row[:length]] for row, length in zip(ids, lengths)]
    p = np.mean([np.exp(stepped(m, crops, rows)) for m in members], axis=0)  # [captions, steps, V]
    out = []
    for probs, row in zip(p, rows):
        pieces = row + [END_ID] * int(len(row) < max_length)
        out.append(sum(math.log(probs[t, piece]) for t, piece in enumerate(pieces)))
    return out


@pytest.mark.slow
def test_prefix_lm_models_of_one_tokenizer_caption_evaluate_and_export_as_an_ensemble(
        trained_prefix_lm_dir, scst_run, tmp_path):
    """Two prefix_lm models over the same GPT-2 tokenizer (the fixture and the SCST run's model started from it) are
    one ensemble: its captions' log-probabilities are the log of the members' averaged probabilities of their pieces
    (not either member's), and ``caption``, ``evaluate`` and ``export`` take both folders."""
    from captioning import inference
    from captioning.config import DecodeConfig
    from captioning.data.reading import model_input

    dirs = copies([trained_prefix_lm_dir, scst_run.folder], tmp_path)
    images = photos(tmp_path)
    trained = inference.load(dirs)
    assert [m.model.__class__.__name__ for m in trained.members] == ["PrefixLM", "PrefixLM"]
    crops = np.stack([model_input(tf.constant(open(p, "rb").read()), trained.preprocessor).numpy() for p in images])
    members = [m.model for m in trained.members]
    default = dataclasses.replace(trained.config.decode, max_length=6)  # caption's, below: beam 3
    assert default.method == "beam" and default.beam_size == 3
    for settings in (DecodeConfig(method="greedy", max_length=6), default):
        captioner = inference.Captioner(trained, settings)
        out = captioner.decode(tf.constant([open(p, "rb").read() for p in images]))
        ids, lengths, log_probs = out["ids"].numpy(), out["lengths"].numpy(), out["log_probs"].numpy()
        want = ensemble_log_probs(members, crops, ids[:, 0], lengths[:, 0], 6)
        np.testing.assert_allclose(log_probs[:, 0], want, atol=1e-4)
        alone = ensemble_log_probs(members[:1], crops, ids[:, 0], lengths[:, 0], 6)
        assert max(abs(a - b) for a, b in zip(alone, want)) > 1e-3  # the second model counts

    args = [a for d in dirs for a in ("--model-dir", d)]
    cli = run_cli("caption", *args, *images, "--json", "--max-length", "6")
    assert cli.returncode == 0, cli.stderr[-2000:]
    captioned = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [c["image"] for c in captioned] == images
    assert all(c["attention"] is None and "prefix_lm" in c["attention_absent"] for c in captioned)  # said, as alone
    texts = captioner.caption([open(p, "rb").read() for p in images])  # the model's decode: the loop's last
    assert [c["captions"][0]["caption"] for c in captioned] == [t[0].text for t in texts]

    evaluated = run_cli("evaluate", *args, "--beam-size", "2", "--max-length", "6")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert evaluated.stdout.startswith("test: 4 images, an ensemble of 2 models, beam 2, perplexity ")
    assert any("-ensemble2-" in n for n in os.listdir(os.path.join(dirs[0], "eval")))

    out = tmp_path / "export"
    exported = run_cli("export", *args, "--output", str(out), "--max-length", "6")
    assert exported.returncode == 0, exported.stderr[-2000:]
    marker = json.loads((out / "captioning_export.json").read_text())
    assert [m["model_dir"] for m in marker["members"]] == [os.path.abspath(d) for d in dirs]


def test_an_ensemble_of_models_of_different_tokenizers_is_refused_in_one_line(
        trained_prefix_lm_dir, trained_model_dir, lm_presets, tmp_path):
    """A word model with a prefix_lm one, and two prefix_lm models whose presets tokenize differently (GPT-2's
    byte-level BPE, Gemma's SentencePiece), are refused before any model is built, naming both folders and both
    tokenizers."""
    from captioning.data.tokenizers import load_tokenizer
    from captioning.data.tokenizers.preset import FOLDER, PresetTokenizer

    gemma = tmp_path / "gemma_model"  # a prefix_lm folder over the Gemma preset: its config and tokenizer
    shutil.copytree(trained_prefix_lm_dir, gemma)
    shutil.rmtree(gemma / FOLDER)
    PresetTokenizer.from_preset(lm_presets["gemma"]).save_to(str(gemma))
    config = (gemma / "config.yaml").read_text()
    assert lm_presets["gpt2"] in config
    (gemma / "config.yaml").write_text(config.replace(lm_presets["gpt2"], lm_presets["gemma"]))
    photo = photos(tmp_path, 1)[0]
    gpt2, words, other = (load_tokenizer(str(d)) for d in (trained_prefix_lm_dir, trained_model_dir, gemma))
    assert gpt2.kind == other.kind == "preset" and words.kind == "words"
    reason = ("an ensemble averages probabilities over one id space, so its models must share one tokenizer (the same "
              "model.decoder_preset's, or the same word vocabulary)")
    cases = [
        (("caption", photo, "--model-dir", trained_model_dir, "--model-dir", trained_prefix_lm_dir),
         f"the models in {trained_model_dir} and {trained_prefix_lm_dir} have different tokenizers (a word vocabulary "
         f"of {len(words)} ids; the preset tokenizer {gpt2.identity} of {len(gpt2)} ids): {reason}"),
        (("evaluate", "--model-dir", trained_prefix_lm_dir, "--model-dir", str(gemma)),
         f"the models in {trained_prefix_lm_dir} and {gemma} have different tokenizers (the preset tokenizer "
         f"{gpt2.identity} of {len(gpt2)} ids; the preset tokenizer {other.identity} of {len(other)} ids): {reason}"),
        (("export", "--model-dir", trained_prefix_lm_dir, "--model-dir", trained_model_dir, "--output",
          str(tmp_path / "e")),
         f"the models in {trained_prefix_lm_dir} and {trained_model_dir} have different tokenizers (the preset "
         f"tokenizer {gpt2.identity} of {len(gpt2)} ids; a word vocabulary of {len(words)} ids): {reason}"),
    ]
    assert gpt2.identity.startswith("preset-GPT2Tokenizer-") and other.identity.startswith("preset-GemmaTokenizer-")
    for args, message in cases:
        done = run_cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1] == f"captioning {args[0]}: error: {message}"
    assert not os.path.exists(tmp_path / "e")


# ------------------------------------------------------------------------------------------------ SCST

SCST = ("train.objective=scst", "data.captions_per_image=grouped", "train.optimizer=adam", "train.learning_rate=0.003",
        "scst.samples=3", "train.batch_size=10", "scst.max_length=12")


@pytest.fixture(scope="module")
def scst_run(trained_prefix_lm_dir, prepared_dir, lm_presets, tmp_path_factory):
    """SCST started from the fixture's cross-entropy checkpoint (``init_from``), 4 steps, then saved: the trainer,
    its weights before, each step's outputs, 3 sample captions and the model folder (the ensemble's second
    member, below: one training for both tests)."""
    import types

    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, *plm(lm_presets["gpt2"], "model.lm_trainable=true", "train.steps=4",
                                                *SCST))
    folder = str(tmp_path_factory.mktemp("plm_scst") / "scst")
    trainer = Trainer(for_training(cfg), folder, init_from=trained_prefix_lm_dir)
    start = [v.numpy() for v in trainer.model.trainable_variables]
    dataset = trainer.distributed_dataset(cfg.data.train_split, training=True)
    step, batches = trainer.train_step_for(dataset), iter(dataset)
    outs = [{k: float(v) for k, v in step(next(batches)).items()} for _ in range(4)]
    samples = trainer.sample_captions(3)
    trainer.save()
    return types.SimpleNamespace(trainer=trainer, start=start, outs=outs, samples=samples, folder=folder)


@pytest.mark.slow
def test_scst_from_a_prefix_lm_checkpoint_rewards_words_and_learns(scst_run):
    """SCST started from the fixture's cross-entropy checkpoint (``init_from``): each step's reward (CIDEr-D of the
    samples' detokenized words, in the graph) is finite and moves, the loss is finite and the weights change; the
    sample captions are words, each noted with its reward."""
    import re

    trainer, start, outs = scst_run.trainer, scst_run.start, scst_run.outs
    assert trainer.objective.words is not None  # the reward reads words, not GPT-2's pieces
    rewards = [o["reward"] for o in outs]
    assert all(math.isfinite(o["loss"]) and math.isfinite(o["reward"]) for o in outs), outs
    assert 0 <= min(rewards) and len(set(rewards)) > 1 and max(rewards) > 0, rewards  # CIDEr-D >= 0, moving
    moved = max(float(np.max(np.abs(v.numpy() - s))) for v, s in zip(trainer.model.trainable_variables, start))
    assert moved > 1e-4
    samples = scst_run.samples
    assert len(samples) == 3
    for sample in samples:
        assert re.fullmatch(r"reward \d+\.\d{3}", sample.note), sample.note
        assert sample.caption == " ".join(sample.caption.split()) and sample.caption  # words, one space apart
        assert all(w.isalpha() for w in sample.caption.split()), sample.caption  # no byte-level marks (Ġ...)
        assert all(w.isalpha() for w in sample.reference.split())


# ------------------------------------------------------------------------------------------------ EMA, accumulation


@pytest.mark.slow
def test_accumulation_and_the_weight_average_with_a_frozen_lm(prepared_dir, lm_presets, scst_run, tmp_path):
    """A frozen LM's prefix_lm with ``train.accumulate_steps: 2`` and ``train.ema_decay: 0.5``: 2 micro-batches
    update the mapper (and encoder) as one step on their joined batch, the average moves half way to the new
    weights, and the LM's weights stay bit-identical to the preset's through both (it has no average); the folder
    loaded with ``weights="ema"`` holds the averages and the preset's LM. The batches are tokenized by the SCST run's
    tokenizer, the same preset's (its identity the run's own), whose graph that run's input pipeline traced already
    (a preset tokenizer traces once per tokenizer in a process: 1.5-2.7 CPU s)."""
    import keras_hub

    from captioning.experiment import for_training
    from captioning.model.folder import ModelDir
    from captioning.train import Trainer
    from tests.harness.training import restore, snapshot

    cfg = small_train_config(prepared_dir, *GROUPED, *plm(lm_presets["gpt2"]), "train.optimizer=adam",
                             "train.learning_rate=0.05", "train.batch_size=10", "train.accumulate_steps=2",
                             "train.ema_decay=0.5")
    trainer = Trainer(for_training(cfg), str(tmp_path / "m"), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    model = trainer.model
    lm = {id(v) for v in model.backbone.weights}
    assert lm and not lm & {id(v) for v in model.trainable_variables}  # frozen
    assert not lm & {id(v) for v, _ in trainer.average.pairs}
    preset = keras_hub.models.Backbone.from_preset(lm_presets["gpt2"])
    tokenizer = scst_run.trainer.vocab
    assert tokenizer is not trainer.vocab and tokenizer.identity == trainer.vocab.identity  # the pieces the run reads
    first, second = grouped_batches(cfg, 2, images=2, tokenizer=tokenizer)  # GPT-2's pieces
    assert int(tf.reduce_max(first["input_ids"])) > len(trained_words(prepared_dir))  # (not the records' word ids)
    start, trained = snapshot(trainer), [v.numpy() for v in model.trainable_variables]

    micro = tf.data.Dataset.from_tensors(first).concatenate(tf.data.Dataset.from_tensors(second))
    got = {k: float(v) for k, v in trainer.train_step_for(micro)([first, second]).items()}
    after = [v.numpy() for v in model.trainable_variables]
    assert int(trainer.step.numpy()) == int(trainer.optimizer.iterations.numpy()) == 1
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    averaged = 0
    for variable, average in trainer.average.pairs:
        if id(variable) in position:
            i = position[id(variable)]
            np.testing.assert_allclose(average.numpy(), 0.5 * trained[i] + 0.5 * after[i], rtol=1e-6, atol=1e-7)
            averaged += 1
    assert averaged == len(trained)
    averages = {id(variable): average.numpy() for variable, average in trainer.average.pairs}
    trainer.save()  # the weight average is what `caption --weights ema` reads: the LM's own weights beside it
    ema = ModelDir(str(tmp_path / "m")).load(weights="ema").model
    for mine, loaded in zip(model.variables, ema.variables):
        want = averages.get(id(mine), mine.numpy() if id(mine) not in position else None)
        np.testing.assert_array_equal(loaded.numpy(), want, err_msg=mine.path)
    for mine, theirs in zip(ema.backbone.weights, preset.weights):
        assert np.array_equal(mine.numpy(), theirs.numpy()), mine.path

    restore(trainer, start)
    big = tf.data.Dataset.from_tensors(joined(first, second))
    expected = {k: float(v) for k, v in trainer._compiled(trainer._train_step, big)(joined(first, second)).items()}
    assert got["weight"] == expected["weight"] and got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    for v, want in zip(model.trainable_variables, after):
        # Adam moves each weight by about the rate (0.05) whatever its gradient's size: a gradient near 0, summed in
        # another order through the LM, moves by up to 1e-4 of that (3e-6 measured)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=v.name)
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(after, trained)) > 1e-3
    for mine, theirs in zip(model.backbone.weights, preset.weights):
        assert mine.shape == theirs.shape and np.array_equal(mine.numpy(), theirs.numpy()), mine.path


# ------------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def loaded(trained_prefix_lm_dir):
    """The fixture model loaded, three encoded pictures and the crops it sees of them."""
    from captioning import inference
    from captioning.data.reading import model_input

    trained = inference.load(trained_prefix_lm_dir)
    encoded = [encode(gradient(size=s).rotate(40 * i), "PNG") for i, s in enumerate([(48, 40), (64, 64), (30, 50)])]
    crops = np.stack([model_input(tf.constant(e), trained.preprocessor).numpy() for e in encoded])
    return trained, encoded, crops


def stepped(model, crops, rows):
    """The model's log-softmax ``[len(rows), longest + 1, V]`` reading <start> then each row's pieces (after them
    <end>s, which change nothing before), one step at a time: every row a row of one batch, its own crop."""
    from captioning.vocab import END_ID, START_ID

    steps = max(map(len, rows)) + 1
    tokens = np.full((len(rows), steps), END_ID, np.int32)
    tokens[:, 0] = START_ID
    for i, row in enumerate(rows):
        tokens[i, 1:len(row) + 1] = row
    state = model.reserve(model.image_state({"image": tf.constant(np.stack(crops))}), steps)
    out = []
    for t in range(steps):
        logits, state = model.step(tf.constant(tokens[:, t]), state)
        out.append(tf.nn.log_softmax(logits).numpy())
    return np.stack(out, axis=1)


class EndBoosted(tf.Module):
    """A model's steps with ``boost`` added to ``<end>``'s logit: its captions end as soon as the search lets them
    (min_length, bad endings). The fixture's 30 steps never end a caption within 20 pieces on their own."""

    attends = False

    def __init__(self, model, boost=40.0):
        super().__init__()
        self.model, self.vocab_size, self.boost = model, model.vocab_size, boost

    def image_state(self, inputs, training=False):
        return self.model.image_state(inputs, training)

    def reserve(self, state, steps):
        return self.model.reserve(state, steps)

    def step(self, token_ids, state):
        from captioning.vocab import END_ID

        logits, state = self.model.step(token_ids, state)
        return logits + self.boost * tf.one_hot(END_ID, self.vocab_size), state


@pytest.mark.slow
def test_every_decoding_option_on_a_prefix_lm_model(loaded):
    """Greedy, beams, length penalties, diverse beams, sampling (temperature, top-k, top-p, seeds), n-gram blocking
    and bad endings over the words the pieces spell, and min_length in pieces, through the Captioner (min_length:
    the search's own argument, the Captioner's being 1) on the fixture prefix_lm model over GPT-2's tokenizer."""
    from captioning import inference
    from captioning.config import DecodeConfig
    from captioning.model.decode import beam_search
    from captioning.model.sampling import sample_search
    from captioning.model.word_rules import word_table
    from captioning.vocab import END_ID

    trained, encoded, crops = loaded
    model, tokenizer = trained.model, trained.vocab
    assert tokenizer.kind == "preset"

    captioners = {}  # one Captioner (one trace) for each decoding: a second call reuses it

    def captioner(**options):
        key = repr(sorted(options.items()))
        if key not in captioners:
            captioners[key] = inference.Captioner(trained, DecodeConfig(**options))
        return captioners[key]

    def decoded(**options):
        out = captioner(**options).decode(tf.constant(encoded))
        return {k: out[k].numpy() for k in ("ids", "lengths", "log_probs", "scores")}

    def own_log_probs(images, captions, lengths, max_length):
        """Each caption's log p by the model stepped over its pieces (and <end> when it ended before
        ``max_length``), and its log-softmax at every step."""
        rows = [[int(i) for i in ids[:length]] for ids, length in zip(captions, lengths)]
        logp = stepped(model, [crops[i] for i in images], rows)
        totals = [sum(p[t, piece] for t, piece in enumerate(row)) + (p[len(row), END_ID] if len(row) < max_length
                                                                    else 0.0) for p, row in zip(logp, rows)]
        return totals, logp

    def words(ids, length):
        return tokenizer.decode([int(i) for i in ids[:length]])

    # greedy: the likeliest piece at every step (<end> not first); its log p the model's
    greedy = decoded(method="greedy", max_length=8)
    totals, logps = own_log_probs(range(3), greedy["ids"][:, 0], greedy["lengths"][:, 0], 8)
    for ids, length, lp, total, logp in zip(greedy["ids"][:, 0], greedy["lengths"][:, 0], greedy["log_probs"][:, 0],
                                            totals, logps):
        logp[0, END_ID] = -np.inf
        assert list(ids[:length]) == [int(np.argmax(logp[t])) for t in range(length)]
        assert lp == pytest.approx(total, abs=1e-4)
    # beams: top_k captions, their log p the model's, ranked; the length penalties divide by (pieces + <end>)
    for alpha, form in ((0.0, "avg"), (1.0, "avg"), (0.7, "gnmt")):
        beams = decoded(beam_size=3, top_k=3, max_length=8, length_normalization=alpha, length_penalty=form)
        totals, _ = own_log_probs(np.repeat(range(3), 3), beams["ids"].reshape(9, -1), beams["lengths"].reshape(9), 8)
        for i in range(3):
            for k in range(3):
                length = beams["lengths"][i, k]
                assert beams["log_probs"][i, k] == pytest.approx(totals[3 * i + k], abs=1e-4)
                counted = length + int(length < 8)
                penalty = 1.0 if not alpha else counted ** alpha if form == "avg" else ((5 + counted) / 6) ** alpha
                assert beams["scores"][i, k] == pytest.approx(beams["log_probs"][i, k] / penalty, rel=1e-5)
            assert list(beams["scores"][i]) == sorted(beams["scores"][i], reverse=True)
        if not alpha:  # ranked by log p, the beam's best is at least the greedy caption
            assert all(beams["log_probs"][:, 0] >= greedy["log_probs"][:, 0] - 1e-5)
    # diverse beams: a large diversity makes the second group start with another piece than the first
    diverse = decoded(beam_size=4, beam_groups=2, diversity=100.0, top_k=2, max_length=8)
    assert all(diverse["ids"][:, 0, 0] != diverse["ids"][:, 1, 0]), diverse["ids"][:, :, 0]
    # sampling: seeded, each piece among the sample_top_k likeliest, log p the model's own (temperature 1)
    sampled = decoded(method="sample", top_k=2, temperature=0.7, sample_top_k=3, seed=3, max_length=8)
    again = decoded(method="sample", top_k=2, temperature=0.7, sample_top_k=3, seed=3, max_length=8)
    np.testing.assert_array_equal(sampled["ids"], again["ids"])
    totals, logps = own_log_probs(np.repeat(range(3), 2), sampled["ids"].reshape(6, -1), sampled["lengths"].reshape(6),
                                  8)
    for i in range(3):
        for k in range(2):
            length, total, logp = sampled["lengths"][i, k], totals[2 * i + k], logps[2 * i + k]
            logp[0, END_ID] = -np.inf
            ranks = [int(np.sum(logp[t] > logp[t, p])) for t, p in enumerate(sampled["ids"][i, k, :length])]
            assert max(ranks) < 3, ranks
            assert sampled["log_probs"][i, k] == pytest.approx(total, abs=1e-4)
    hot = [decoded(method="sample", top_k=2, temperature=2.0, seed=s, max_length=8)["ids"] for s in (3, 4)]
    assert not np.array_equal(hot[0], hot[1])  # another seed, other captions
    nucleus = decoded(method="sample", top_k=1, sample_top_p=1e-4, seed=5, max_length=8)  # the likeliest piece only
    np.testing.assert_array_equal(nucleus["ids"], greedy["ids"])

    # min_length counts pieces (the search's steps); bad endings read the last word, whatever pieces spelt it
    boosted, words_of = EndBoosted(model), word_table(tokenizer)
    state = boosted.image_state({"image": tf.constant(crops)})
    for min_length in (1, 3, 5):
        out = beam_search(boosted, None, beam_size=2, max_length=8, initial_state=state, min_length=min_length,
                          words=words_of)
        assert out["lengths"].numpy()[:, 0].tolist() == [min_length] * 3  # <end> as soon as it may
        keys = tf.constant([1, 2, 3], tf.int64)
        drawn = sample_search(boosted, state, max_length=8, samples=2, min_length=min_length, keys=keys, words=words_of)
        assert drawn["lengths"].numpy().tolist() == [[min_length] * 2] * 3
    first = beam_search(boosted, None, beam_size=1, max_length=8, initial_state=state, min_length=1, words=words_of)
    endings = [words(ids, n)[-1] for ids, n in zip(first["ids"].numpy()[:, 0], first["lengths"].numpy()[:, 0])]
    bad = sorted(set(endings))
    ruled = beam_search(boosted, None, beam_size=1, max_length=8, initial_state=state, min_length=1, words=words_of,
                        bad_endings=tuple(bad))
    for before, n_before, ids, n in zip(first["ids"].numpy()[:, 0], first["lengths"].numpy()[:, 0],
                                        ruled["ids"].numpy()[:, 0], ruled["lengths"].numpy()[:, 0]):
        assert n_before < 8 and (n == 8 or words(ids, n)[-1] not in bad), (words(ids, n), bad)  # ended elsewhere
        assert words(ids, n) != words(before, n_before)  # or went on to max_length

    # n-gram blocking reads words: the unblocked captions repeat "a" ("a a a ..."; greedy's at 8 pieces, whose
    # complete words start its captions at 20); blocked, no complete word follows itself (n = 1) and no word bigram
    # comes twice (n = 2). A caption cut at max_length has a last word the rules could not complete (its next piece
    # might have continued it): it is left out. Greedy's n = 1 decoding also takes decode.bad_endings (the words
    # above), which the Captioner hands its search: no caption that ends ends on one (a Captioner fewer than on its
    # own; the unboosted model's captions run to max_length, so what the rule does is the boosted search's check above)
    said = [words(ids, n)[:-1] if n == 8 else words(ids, n) for ids, n in zip(greedy["ids"][:, 0],
                                                                              greedy["lengths"][:, 0])]
    assert all(any(a == b for a, b in zip(w, w[1:])) for w in said), said
    for n in (1, 2):
        for options in (dict(method="greedy"), dict(beam_size=3, top_k=2)):
            endings = bad if n == 1 and options.get("method") == "greedy" else []
            settings = dict(max_length=20, block_ngrams=n, bad_endings=endings, **options)
            out = decoded(**settings)
            assert captioner(**settings).bad_endings == tuple(endings)
            assert out["ids"].shape == (3, options.get("top_k", 1), 20)
            for ids, length in zip(out["ids"].reshape(-1, 20), out["lengths"].reshape(-1)):
                complete = words(ids, length)[:-1] if length == 20 else words(ids, length)
                assert len(complete) >= 3
                assert length == 20 or complete[-1] not in endings, (complete, endings)
                grams = [tuple(complete[j:j + n]) for j in range(len(complete) - n + 1)]
                if n == 1:
                    assert all(a != b for a, b in zip(complete, complete[1:])), complete
                else:
                    assert len(set(grams)) == len(grams), complete
