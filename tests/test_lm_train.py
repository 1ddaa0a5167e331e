"""A language model to start from, offline (issue 50, item 4): ``captioning synth --text-only`` writes the
synthetic scenes' captions alone, and ``captioning lm train`` trains a tokenizer and a keras-hub causal LM on
text and writes a preset folder that keras-hub loads."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import REPO, run_main

# a few hundred captions of the hard scenes: what the tokenizers and the tiny models learn from here
SENTENCES = 60  # images, five captions each


def one_error(code, err, expected):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines and lines[-1].startswith("captioning "), err
    assert expected in lines[-1], lines[-1]
    assert "Traceback" not in err
    return lines[-1]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """``synth --text-only``'s captions of 60 hard scenes (300 lines)."""
    folder = tmp_path_factory.mktemp("text")
    code, _, err = run_main("-q", "synth", "--output-dir", folder, "--scenes", "hard", "--num-images", SENTENCES,
                            "--text-only")
    assert code == 0, err
    return str(folder / "captions.txt")


# ---- synth --text-only -----------------------------------------------------------------------------------------

def test_synth_text_only_writes_every_caption_of_every_scene_deterministically(tmp_path, monkeypatch):
    """Every caption of every image, one a line, no image; the same flags give the same bytes whether one process
    or two draw the blocks, a smaller run is the start of a larger one, a rerun is a no-op, a folder of other
    files is refused in one line."""
    from data_prep import scenes, synth

    code, out, err = run_main("synth", "--output-dir", tmp_path / "a", "--scenes", "hard", "--num-images", "7",
                              "--text-only", "--seed", "3")
    assert code == 0, err
    assert os.listdir(tmp_path / "a") == ["captions.txt", "text_only.json"] or \
        sorted(os.listdir(tmp_path / "a")) == ["captions.txt", "text_only.json"]
    lines = (tmp_path / "a" / "captions.txt").read_text().splitlines()
    rng = np.random.default_rng([3, 0])  # block 0 of seed 3: the scenes' own caption maker, image by image
    assert lines == [c for _ in range(7) for c in scenes.make_captions(rng)] and len(lines) == 35
    assert "35 captions of 7 images" in out
    record = json.loads((tmp_path / "a" / "text_only.json").read_text())
    assert (record["scenes"], record["seed"], record["num_images"], record["captions"]) == ("hard", 3, 7, 35)

    monkeypatch.setattr(synth, "TEXT_BLOCK", 3)  # three blocks: 3, 3 and 1 images
    one = synth.synthesize_text(str(tmp_path / "b"), 7, seed=3, scenes="hard", progress=False, workers=1)
    two = synth.synthesize_text(str(tmp_path / "c"), 7, seed=3, scenes="hard", progress=False, workers=2)
    small = synth.synthesize_text(str(tmp_path / "d"), 4, seed=3, scenes="hard", progress=False, workers=1)
    b, c, d = ((tmp_path / n / "captions.txt").read_bytes() for n in "bcd")
    assert one == two == {"images": 7, "captions": 35, "written": 35} and small["captions"] == 20
    assert b == c and b.startswith(d) and b.count(b"\n") == 35 and b != (tmp_path / "a" / "captions.txt").read_bytes()

    before = os.stat(tmp_path / "b" / "captions.txt").st_mtime_ns
    again = synth.synthesize_text(str(tmp_path / "b"), 7, seed=3, scenes="hard", progress=False, workers=1)
    assert again["written"] == 0 and os.stat(tmp_path / "b" / "captions.txt").st_mtime_ns == before
    code, out, _ = run_main("synth", "--output-dir", tmp_path / "a", "--scenes", "hard", "--num-images", "7",
                            "--text-only", "--seed", "3")
    assert code == 0 and "nothing to do" in out

    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine\n")
    one_error(*run_main("synth", "--output-dir", tmp_path / "e", "--num-images", "3", "--text-only")[::2],
              "holds other files (notes.txt); pass --overwrite")
    assert os.listdir(tmp_path / "e") == ["notes.txt"]


# ---- the tokenizers ----------------------------------------------------------------------------------------------

def test_the_tokenizers_trained_on_the_text_round_trip_it(text_file):
    """GPT-2's byte-level BPE and Gemma's SentencePiece, trained here on the captions, encode every normalised
    caption and decode it back exactly; the special tokens sit at the ids keras-hub's tokenizers expect; whole
    scene words are single pieces after the training."""
    from captioning.train.language_model import make_tokenizer
    from data_prep.lm_text import normalize, read_text_file, train_byte_level_bpe, train_sentencepiece

    sentences = read_text_file(text_file)
    raw = open(text_file, encoding="utf-8").read().splitlines()
    assert sentences == [normalize(line) for line in raw] and any(line != normalize(line) for line in raw)
    assert all(s == s.lower() and "." not in s and "," not in s for s in sentences)
    vocabulary, merges = train_byte_level_bpe(sentences, 1000)
    gpt2 = make_tokenizer("gpt2", {"vocabulary": vocabulary, "merges": merges})
    gemma = make_tokenizer("gemma", {"proto": train_sentencepiece(sentences, 1000)})
    assert vocabulary["<|endoftext|>"] == len(vocabulary) - 1 == gpt2.start_token_id == gpt2.end_token_id != 0
    assert (gemma.pad_token_id, gemma.end_token_id, gemma.start_token_id) == (0, 1, 2)
    assert gemma.id_to_token(3) == "<unk>"
    texts = sentences + ["zebra crossing"]  # a word never seen still encodes (in bytes), and decodes back
    for tokenizer in (gpt2, gemma):
        ids = tokenizer(texts)
        assert [str(t) for t in tokenizer.detokenize(ids)] == texts
        assert max(len(i) / len(t.split()) for i, t in zip(ids, sentences)) <= 2  # words learnt, not spelt in bytes
    assert len(gpt2("a hexagon")) == 2 and "Ġhexagon" in vocabulary
    # the language model learns a sentence's first word as the caption decoder's tokenizer splits it: space-led
    from captioning.train.language_model import needs_space

    assert needs_space(gpt2) and not needs_space(gemma)
    assert [gpt2.id_to_token(i) for i in gpt2(" a red circle")] == ["Ġa", "Ġred", "Ġcircle"]


# ---- lm train: one-line refusals ---------------------------------------------------------------------------------

def _refusals(tmp, text_file):
    empty = tmp / "empty.txt"
    empty.write_text("\n . \n\n")
    other = tmp / "other"
    other.mkdir(exist_ok=True)
    (other / "notes.txt").write_text("mine\n")
    base = ["lm", "train", "--text", text_file, "--output", str(tmp / "lm"), "--steps", "2"]
    return {
        "missing text": (["lm", "train", "--text", str(tmp / "nope.txt"), "--output", str(tmp / "lm")],
                         "--text " + str(tmp / "nope.txt") + " does not exist"),
        "empty text": (["lm", "train", "--text", str(empty), "--output", str(tmp / "lm")],
                       "holds 0 sentence(s) with a word in them"),
        "unknown architecture": (base + ["--architecture", "bert"], "argument --architecture: invalid choice"),
        "unknown size": (base + ["--architecture", "gemma", "--size", "base"],
                         "--size of gemma must be one of tiny, small, 2b, got 'base'"),
        "steps 0": (base + ["--steps", "0"], "--steps: must be an integer in [1, 10,000,000], got 0"),
        "steps too many": (base + ["--steps", "10000001"], "must be an integer in [1, 10,000,000]"),
        "learning rate 0": (base + ["--learning-rate", "0"], "--learning-rate: must be a number in"),
        "sequence longer than the positions": (base + ["--sequence-length", "129"],
                                               "--sequence-length 129 is longer than the 128 positions"),
        "output is the text": (["lm", "train", "--text", text_file, "--output", text_file], "is also an input"),
        "output holds the text": (["lm", "train", "--text", text_file, "--output", os.path.dirname(text_file)],
                                  "is also an input"),
        "output holds other files": (["lm", "train", "--text", text_file, "--output", str(other), "--steps", "2"],
                                     "holds files `captioning lm train` did not write"),
        "split of a file": (base + ["--split", "train"], "--split is for a prepared dataset folder"),
    }


def test_lm_train_refuses_bad_input_in_one_line_before_any_work(text_file, tmp_path):
    for name, (args, expected) in _refusals(tmp_path, text_file).items():
        code, _, err = run_main(*args)
        one_error(code, err, expected)
        assert not os.path.exists(tmp_path / "lm"), name


def test_lm_train_refuses_an_output_inside_or_around_the_dataset_it_reads(prepared_dir, tmp_path):
    before = sorted(os.listdir(prepared_dir))
    for output, words in ((os.path.join(prepared_dir, "lm"), "lies inside the prepared dataset"),
                          (prepared_dir, "is the prepared dataset"),
                          (os.path.dirname(prepared_dir), "holds the prepared dataset")):
        one_error(*run_main("lm", "train", "--text", prepared_dir, "--output", output)[::2], words)
    one_error(*run_main("lm", "train", "--text", prepared_dir, "--split", "nope", "--output", tmp_path / "lm")[::2],
              "split 'nope' is not in")
    assert sorted(os.listdir(prepared_dir)) == before


# ---- lm train: the preset ----------------------------------------------------------------------------------------

def killed_at_its_first_log_line(args, err_path):
    """``captioning ARGS`` in a real process killed with SIGKILL mid-training, at its first log line of a step (a
    run of 30 steps logs every 3): its exit status."""
    argv = [sys.executable, "-m", "captioning", *args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    with open(err_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while " of 30: loss" not in open(err_path).read() and proc.poll() is None:
            assert time.monotonic() < deadline, open(err_path).read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def trained(text_file, prepared_dir, tmp_path_factory):
    """GPT-2 trained on the text file and Gemma on the prepared dataset's training captions, tiny, 30 steps each.
    Gemma's command first runs in a process of its own killed mid-training (SIGKILL); what that left in the output's
    folder is kept under ``"killed"``, then the same command completes here. (Gemma's: its SentencePiece tokenizer is
    one op, where GPT-2's byte-level BPE costs that process seconds of tracing before its first step.) Each run's
    packed token streams, as ``token_streams`` returned them to it (the training sentences', then the held-out
    ones'), are kept with the sentences under ``"ARCHITECTURE streams"``."""
    from captioning.train import language_model

    root = tmp_path_factory.mktemp("lm")
    runs = {"gemma": ["--text", prepared_dir, "--split", "train"], "gpt2": ["--text", text_file]}
    results = {}
    for architecture, text in runs.items():
        args = ["lm", "train", "--architecture", architecture, *text, "--steps", "30", "--batch-size", "8",
                "--sequence-length", "32", "--learning-rate", "0.003", "--output", str(root / architecture)]
        if architecture == "gemma":
            err = tmp_path_factory.mktemp("killed") / "err"
            code = killed_at_its_first_log_line(args, err)
            results["killed"] = (code, sorted(os.listdir(root)), err.read_text())
        streams, real = results.setdefault(f"{architecture} streams", []), language_model.token_streams

        def kept(tokenizer, *groups, streams=streams, real=real, **options):
            out = real(tokenizer, *groups, **options)
            streams.extend((list(group), stream) for group, stream in zip(groups, out))
            return out

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(language_model, "token_streams", kept)
            results[architecture] = (args, *run_main(*args))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["gpt2", "gemma"])
def test_the_preset_loads_offline_with_keras_hub_and_the_loss_fell(trained, architecture):
    import keras_hub

    args, code, out, err = trained[architecture]
    assert code == 0, err
    output = args[args.index("--output") + 1]
    record = json.load(open(os.path.join(output, "training.json")))
    figures = record["figures"]
    # the loss fell from the uniform guess (log of the vocabulary) to below the pieces' own frequencies
    assert figures["first_loss"] > np.log(figures["vocabulary_size"]) - 0.5
    assert figures["final_loss"] < figures["first_loss"] - 1.0
    assert figures["held_out_loss"] < figures["unigram_entropy"] + 0.5
    assert np.isclose(figures["held_out_perplexity"], np.exp(figures["held_out_loss"]))
    assert "held out: loss" in err and "greedy continuation of" in err and "held-out perplexity" in out
    backbone = keras_hub.models.Backbone.from_preset(output)
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(output)
    assert type(backbone).__name__ == {"gpt2": "GPT2Backbone", "gemma": "GemmaBackbone"}[architecture]
    assert backbone.count_params() == figures["parameters"] and backbone.hidden_dim == 128
    assert tokenizer.vocabulary_size() == figures["vocabulary_size"] == backbone.vocabulary_size
    assert tokenizer.detokenize(tokenizer("a red circle")) == "a red circle"
    # the packed streams it learnt from and was scored on (the run's own): each sentence framed by the special
    # tokens, GPT-2's with a space in front (its first word a space-led piece), in the preset's tokenizer's pieces
    (training, stream), (held, held_stream) = trained[f"{architecture} streams"]
    assert (len(training), len(held), len(stream)) == (figures["training_sentences"], figures["held_out_sentences"],
                                                        figures["training_tokens"])
    for sentences, got in ((training, stream), (held, held_stream)):
        if architecture == "gpt2":
            end, pieces = tokenizer.end_token_id, tokenizer([" " + s for s in sentences])
            assert got.tolist() == [end] + [i for p in pieces for i in (*p, end)]
            assert all(tokenizer.id_to_token(p[0]).startswith("Ġ") for p in pieces)
        else:
            pieces = tokenizer(sentences)
            assert got.tolist() == [i for p in pieces for i in (2, *p, 1)] + [1]
    assert record["settings"] == {"architecture": architecture, "size": "tiny", "steps": 30, "batch_size": 8,
                                  "sequence_length": 32, "learning_rate": 0.003, "seed": 0}
    assert not [n for n in os.listdir(os.path.dirname(output)) if ".tmp" in n or ".old" in n]


@pytest.mark.slow
def test_a_rerun_of_a_finished_lm_train_is_a_no_op_and_other_settings_need_overwrite(trained):
    args, code, _, err = trained["gpt2"]
    assert code == 0, err
    output = args[args.index("--output") + 1]
    files = {n: os.stat(os.path.join(output, n)).st_mtime_ns for n in os.listdir(output)}
    code, out, err = run_main(*args)
    assert code == 0 and "already holds this language model" in out, err
    assert "step " not in err  # no training
    steps = args.index("--steps") + 1
    one_error(*run_main(*args[:steps], "31", *args[steps + 1:])[::2],
              "holds a language model trained with other settings or text; pass --overwrite")
    assert {n: os.stat(os.path.join(output, n)).st_mtime_ns for n in os.listdir(output)} == files


@pytest.mark.slow
def test_a_killed_lm_train_leaves_no_preset_and_a_rerun_completes(trained):
    """SIGKILL mid-training (a real process, its log showing steps): no output folder and nothing half written;
    the same command then completes and writes a loadable preset."""
    code, left, err = trained["killed"]
    assert code == -signal.SIGKILL and "step 3 of 30" in err, err
    assert left == []  # nothing in the output's folder, under any name
    args, code, out, err = trained["gemma"]
    assert code == 0 and "language model in" in out, err
    import keras_hub

    assert keras_hub.models.Backbone.from_preset(args[args.index("--output") + 1]).count_params() > 0
