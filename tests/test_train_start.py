"""How a training run starts: the objective brings the batches it needs, a refused run leaves the disk as
it found it, the log says what a grouped batch holds, and a folder's own checkpoint wins over --init-from
(issue 19's items 1, 14, 16 and 17)."""

import os
import re

import pytest
import yaml

from captioning.config import save_config
from tests.helpers import copy_model, run_main, small_train_config

TRAINED = ["model.embedding_size=32", "model.lstm_units=32"]  # conftest's trained_model_dir
SCST = ["train.objective=scst", "data.captions_per_image=grouped", "train.optimizer=adam", "train.learning_rate=0.001",
        "scst.samples=3", "train.batch_size=10", "scst.max_length=20"]  # the shapes captions have up to 18 words


def xe_config(path, data_dir, *overrides):
    """A cross-entropy config file, as a user has it (captions_per_image: all given in the file)."""
    save_config(small_train_config(data_dir, *TRAINED, "train.steps=60", *overrides), str(path))
    return str(path)


def sample_captions_logged(logs):
    """(caption, reward) of each sample caption a run's last evaluation wrote to TensorBoard (its text, as the Text
    tab shows it: ``image ID: **CAPTION** (reward R) (reference: ...)``)."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(logs), size_guidance={"tensors": 0})
    events.Reload()
    text = tf.make_ndarray(events.Tensors("sample_captions")[-1].tensor_proto).item().decode()
    lines = text.split("\n\n")
    pattern = r"image \d+: \*\*(.*)\*\* \(reward (\d+\.\d+)\) \(reference: .*\)"
    found = [re.fullmatch(pattern, line, re.S) for line in lines]
    assert all(found), text
    return [(m.group(1), float(m.group(2))) for m in found]


def history(model):
    with open(os.path.join(model, "history.yaml")) as f:
        return yaml.safe_load(f)


@pytest.mark.slow
def test_switching_a_cross_entropy_run_to_scst_with_set_brings_grouped_batches(trained_model_dir, prepared_dir,
                                                                               tmp_path):
    """The commands the SCST issue showed, as shown: the same folder with --set train.objective=scst (and
    more steps), and a new folder from --init-from with a cross-entropy config. --init-from starts a new
    folder from another's weights; the same folder switches to SCST from its latest checkpoint with a new
    optimizer; both resume like any run; the document frequencies are counted once and kept in the folder.
    (tests/test_scst.py's SCST-from-cross-entropy runs are these: one run of each kind for both files.)"""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    config = xe_config(tmp_path / "xe.yaml", prepared_dir)
    same = tmp_path / "same"
    copy_model(trained_model_dir, same)
    scst = ["--set", "train.objective=scst", "--set", "scst.samples=3", "--set", "scst.max_length=20",
            "--set", "train.optimizer=adam", "--set", "train.learning_rate=0.0001"]
    code, out, err = run_main("train", "--config", config, "--model-dir", same, *scst, "--set", "train.steps=62")
    assert code == 0, err
    assert "trained to step 62" in out
    last = history(same)[-1]
    assert last["started_at_step"] == 60 and last["config"]["train"]["objective"] == "scst"
    assert last["config"]["data"]["captions_per_image"] == "grouped"
    assert os.path.exists(same / "cider_document_frequencies.npz")
    # the SCST folder restores like any run (it resumes below, in the --init-from folder's second command; an SCST
    # step moves the weights: tests/test_objectives.py); TensorBoard's sample captions come with their rewards (the
    # --init-from folder's evaluation at step 2, below)
    trainer = Trainer(for_training(small_train_config(prepared_dir, *TRAINED, *SCST, "train.steps=62")), str(same))
    assert trainer.current_step() == 62
    with open(same / "history.yaml") as f:
        text = f.read()
    assert "objective: scst" in text and "objective: xe" in text

    new = tmp_path / "new"
    evaluated = ["--set", "train.eval_every_steps=2", "--set", "train.eval_batches=1"]
    code, out, err = run_main("train", "--config", config, "--model-dir", new, "--init-from", trained_model_dir,
                              *scst, *evaluated, "--set", "train.steps=2")
    assert code == 0, err
    assert history(new)[-1]["config"]["data"]["captions_per_image"] == "grouped"
    assert "initialised the model from" in err and "ckpt-60" in err
    assert "reward" in err and "ended" in err
    samples = sample_captions_logged(new / "logs" / "train")  # train.sample_captions: 3, its default
    assert len(samples) == 3 and all(caption and 0 <= reward <= 10 for caption, reward in samples), samples
    assert "references have more than scst.max_length" not in err  # up to 20 words: all fit
    assert os.path.exists(new / "cider_document_frequencies.npz")
    code, out, err = run_main("train", "--config", config, "--model-dir", new, "--init-from", trained_model_dir,
                              *scst, "--set", "train.steps=3")  # a step more; no evaluation to trace again
    assert code == 0 and "resumed from" in err and "counting the n-grams" not in err, err
    assert "trained to step 3" in out
    code, out, err = run_main("train", "--config", config, "--model-dir", tmp_path / "x", "--init-from", tmp_path,
                              *scst)
    assert code == 2 and "--init-from" in err.strip().splitlines()[-1]
    # an explicit contradicting choice is still refused, in one line, writing nothing
    code, out, err = run_main("train", "--config", config, "--model-dir", tmp_path / "no", *scst,
                              "--set", "data.captions_per_image=sample")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "captioning train: error: train.objective: scst needs data.captions_per_image: grouped, but "
        "data.captions_per_image is sample (with --set); leave data.captions_per_image out, or set it to grouped")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("case", ["init_from_missing", "init_from_other_model", "service_unreachable",
                                  "other_vocabulary"])
def test_a_refused_run_writes_nothing(case, trained_model_dir, trained_attention_dir, prepared_dir, tmp_path):
    config = xe_config(tmp_path / "c.yaml", prepared_dir, "train.steps=2")
    model = tmp_path / "model"
    args = ["train", "--config", config, "--model-dir", model]
    expected = {"init_from_missing": "--init-from {p} holds no trained model (no checkpoint)",
                "init_from_other_model": "--init-from {p} holds a model with other model.decoder",
                "service_unreachable": "no tf.data dispatcher answered at localhost:1 within 1 s",
                "other_vocabulary": "was trained with another vocabulary"}[case]
    before = None
    if case == "init_from_missing":
        args += ["--init-from", tmp_path / "nothing"]
        expected = expected.format(p=tmp_path / "nothing")
    elif case == "init_from_other_model":
        args += ["--init-from", trained_attention_dir]
        expected = expected.format(p=trained_attention_dir)
    elif case == "service_unreachable":
        args += ["--set", "data.service=localhost:1", "--set", "data.service_timeout_s=1", "--set", "data.cache=none"]
    else:  # an existing folder of another vocabulary: a refusal there leaves it as it was (no lock file either)
        copy_model(trained_model_dir, model)
        os.remove(model / "training.lock")
        with open(model / "vocab.txt", "a") as f:
            f.write("zebra\n")
        before = sorted(os.listdir(model))
    code, _, err = run_main(*args)
    assert code == 2 and expected in err.strip().splitlines()[-1], err
    if before is None:
        assert not model.exists()
    else:
        assert sorted(os.listdir(model)) == before


def test_a_refusal_after_the_folder_is_taken_removes_what_it_made(trained_model_dir, prepared_dir, tmp_path):
    """--init-from a folder whose checkpoint does not fit (its config.yaml says otherwise): found when
    restoring, after the lock and the objective's files exist; they go again."""
    source = tmp_path / "source"
    copy_model(trained_model_dir, source)
    with open(source / "config.yaml") as f:
        text = f.read()
    (source / "config.yaml").write_text(text.replace("lstm_units: 32", "lstm_units: 24"))
    config = xe_config(tmp_path / "c.yaml", prepared_dir, "train.steps=2", "model.lstm_units=24")
    code, _, err = run_main("train", "--config", config, "--model-dir", tmp_path / "model", "--init-from", source)
    assert code == 2 and "does not fit the model this config builds" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "model").exists()


def test_the_folders_own_checkpoint_wins_over_init_from_and_says_so(trained_model_dir, prepared_dir, tmp_path,
                                                                     caplog):
    """The rerun of the command that made the folder (its 60 steps, --init-from given): the folder's ckpt-60 is
    where it starts (decided as the run restores, before any step: nothing is left to train, no step to trace),
    not the other folder's weights at step 0."""
    model = tmp_path / "model"
    copy_model(trained_model_dir, model)
    config = xe_config(tmp_path / "c.yaml", prepared_dir)
    with caplog.at_level("INFO", logger="captioning.train"):
        code, out, err = run_main("train", "--config", config, "--model-dir", model, "--init-from", trained_model_dir)
    assert code == 0, err
    assert f"the model folder's own checkpoint ckpt-60 wins over init_from {trained_model_dir}: training resumes " \
           "from it" in caplog.text
    assert "already at step 60 of 60: nothing to train" in caplog.text, caplog.text
    assert "initialised the model from" not in caplog.text + err
    assert "trained to step 60" in out


@pytest.mark.slow
def test_a_grouped_batch_says_what_it_holds_and_epochs_count_images(prepared_dir, tmp_path, caplog):
    """Four batch sizes (1, 3 and 7 give 1 image, 10 gives 2): each run's plan; the training log line of the
    first from a one-step run, which shows that the line prints the plan's text and the trainer's steps per
    epoch; the other three's from their plans and steps per epoch, asserted for each (a step fewer to compile
    for each: the line is printed before anything is traced)."""
    from captioning.data.prepared import PreparedDataset
    from captioning.experiment import for_training
    from captioning.train import Trainer

    split = PreparedDataset.load(prepared_dir).split("train")
    for batch_size, images, run in ((1, 1, True), (3, 1, False), (7, 1, False), (10, 2, False)):
        cfg = small_train_config(prepared_dir, "data.captions_per_image=grouped", f"train.batch_size={batch_size}",
                                 "train.steps=1")
        trainer = Trainer(for_training(cfg), str(tmp_path / f"m{batch_size}"))
        assert trainer.plan.images == images and trainer.steps_per_epoch == split.images // images
        said = (f"global batch {images} image{'s' if images > 1 else ''} with all their captions (about "
                f"{images * split.captions_per_image:.0f} captions; train.batch_size {batch_size})")
        assert trainer.plan.describe() == said
        if not run:
            continue
        caplog.clear()
        with caplog.at_level("INFO", logger="captioning.train"):
            trainer.run(progress=False)
        line = re.search(r"training from step 0 to 1: (.*) on 1 replica\(s\), (\d+) steps per epoch", caplog.text)
        assert line and int(line.group(2)) == split.images // images
        assert line.group(1) == said


def test_an_encoder_learning_rate_scale_with_a_frozen_encoder_is_said_to_do_nothing(prepared_dir, tmp_path, caplog):
    """Issue 48 item 16: train.encoder_lr_scale with model.encoder_trainable: false (or regions read, whose encoder
    is not trained) was ignored without a word; one warning line, as decode's settings that do nothing get."""
    from captioning.config import ineffective
    from captioning.experiment import for_training
    from captioning.model.data_sources import data_source
    from captioning.train import Trainer

    def lines(*overrides):  # the config's lines and its data source's, as a training run says them
        cfg = small_train_config(prepared_dir, *overrides)
        return ineffective(cfg) + data_source(cfg).ineffective()

    said = "train.encoder_lr_scale 0.1 does nothing: the encoder is frozen (model.encoder_trainable: false)"
    assert lines("model.encoder_trainable=false", "train.encoder_lr_scale=0.1") == [said]
    assert lines("train.encoder_lr_scale=0.1", "data.features=regions") == [
        "train.encoder_lr_scale 0.1 does nothing: the encoder is not trained when the decoder reads regions "
        "(data.features: regions)"]
    assert lines("train.encoder_lr_scale=0.1") == lines("model.encoder_trainable=false") == []
    with caplog.at_level("WARNING", logger="captioning.train"):
        Trainer(for_training(small_train_config(prepared_dir, "model.encoder_trainable=false", "train.encoder_lr_scale=0.1",
                                   "train.steps=1")), str(tmp_path / "m"))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [said]
