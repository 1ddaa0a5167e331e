"""train.ema_decay: the weight average (captioning.train.ema) — its value after each applied step, skipped steps,
loss scaling, resuming, gradient accumulation (tests/test_accumulate.py's k-steps run), 2 replicas (the decoder contract's 2-replica run of show_and_tell, which trains with the
average: conftest's ``mirrored_contracts``), steps_per_execution, and --weights ema|raw in caption, export and
evaluate. The models here fine-tune the small CNN encoder, so its batch-norm moving statistics are averaged with
the weights; a checkpoint written before they were (its average of the trainable weights only) still loads."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from tests.harness.averages import (assert_same, averaged_positions, averages, averages_of, checkpoint_averages,
                                    next_average, raw, statistics_positions, trainable_positions)
from tests.harness.scenarios import AVERAGED, DECAY, contract_result
from tests.helpers import run_cli, small_train_config


@pytest.fixture(scope="module")
def averaged(prepared_dir, tmp_path_factory):
    """A model folder trained 4 steps at train.ema_decay 0.5 (steps 1, 2 and 4 applied; step 3's batch made
    non-finite, skipped), saved at step 4; with each step's raw weights, averages and whether it applied, and the
    Trainer and its traced step (the steps_per_execution test takes its single steps on them)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    folder = str(tmp_path_factory.mktemp("ema") / "m")
    cfg = small_train_config(prepared_dir, "train.steps=4", f"train.ema_decay={DECAY}")
    trainer = Trainer(for_training(cfg), folder)
    positions = averaged_positions(trainer.model)
    dataset = trainer.distributed_dataset("train", training=True)
    step, batches = trainer.train_step_for(dataset), iter(dataset)
    record = {"raw": [raw(trainer.model, positions)], "average": [averages(trainer)], "applied": [None]}
    for number in range(1, 5):
        batch = next(batches)
        if number == 3:  # a NaN mask: a non-finite loss, so no update
            batch = {**batch, "mask": batch["mask"] * float("nan")}
        out = step(batch)
        record["applied"].append(bool(np.isfinite(float(out["loss"]))))
        record["raw"].append(raw(trainer.model, positions))
        record["average"].append(averages(trainer))
    trainer.save()
    trainer.folder.release()
    return {"folder": folder, "cfg": cfg, "positions": positions, "trainable": trainable_positions(trainer.model),
            "statistics": statistics_positions(trainer.model), "trainer": trainer, "step": step, **record}


def test_the_average_moves_after_each_applied_step_only_and_is_saved(averaged):
    assert averaged["applied"][1:] == [True, True, False, True]
    expected = averaged["raw"][0]  # a new run's average starts from the initial weights
    assert_same(averaged["average"][0], expected, rtol=0)
    for number in range(1, 5):
        if averaged["applied"][number]:
            expected = next_average(expected, averaged["raw"][number], averaged["statistics"])
        else:  # the skipped step: neither the weights nor their average moved
            for i in expected:
                np.testing.assert_array_equal(averaged["raw"][number][i], averaged["raw"][number - 1][i])
                np.testing.assert_array_equal(averaged["average"][number][i], averaged["average"][number - 1][i])
        assert_same(averaged["average"][number], expected)
    saved = checkpoint_averages(os.path.join(averaged["folder"], "ckpt-4"))
    assert_same(saved, averaged["average"][4], rtol=0)  # the checkpoint holds every trainable weight's average
    assert max(np.abs(saved[i] - averaged["raw"][4][i]).max() for i in saved) > 1e-3  # not the raw weights


def test_the_fine_tuned_encoders_batch_norm_statistics_are_in_the_average(averaged):
    """The small CNN's moving means and variances (5 layers') moved in training, and the checkpoint holds their
    average beside the weights': at DECAY 0.5, their values after the last applied step (see next_average)."""
    statistics = averaged["statistics"]
    assert len(statistics) == 10 and set(statistics) <= set(averaged["positions"])
    raw_start, raw_end = averaged["raw"][0], averaged["raw"][4]
    assert min(np.abs(raw_end[i] - raw_start[i]).max() for i in statistics) > 1e-3  # training moved each
    saved = checkpoint_averages(os.path.join(averaged["folder"], "ckpt-4"))
    assert_same({i: saved[i] for i in statistics}, {i: raw_end[i] for i in statistics}, rtol=0)


def test_the_statistics_average_makes_up_the_delay_the_weights_average_has_beyond_theirs():
    """A real small CNN fine-tuned 3 steps (SGD; forward passes in training mode move its batch norms'
    statistics), averaged at d 0.992: the weights at 0.992 (124 steps late), the statistics (momentum 0.99: 99
    steps late already) at the decay of the 25 steps left, 25 / 26; each average the one recomputed in numpy,
    which neither the weights' decay nor the raw statistics give."""
    import keras
    import tensorflow as tf

    from captioning.model import all_layers
    from captioning.train.ema import WeightAverage, statistics_decay
    from captioning.train.objectives import caption_loss_sum
    from tests.harness.models import inputs, tiny

    model = tiny("show_and_tell")
    norms = [layer for layer in all_layers(model) if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 5 and {layer.momentum for layer in norms} == {0.99}
    trainable, statistics = trainable_positions(model), statistics_positions(model)
    average = WeightAverage(model, 0.992, tf.distribute.get_strategy())
    assert average.decays == [0.992] * len(trainable) + [pytest.approx(25 / 26, abs=1e-12)] * 10
    assert statistics_decay(0.992, 0.99, micro_batches=4) == pytest.approx(99.25 / 100.25, abs=1e-12)  # 124 − 99 / 4
    optimizer = keras.optimizers.SGD(0.5)
    images, ids = inputs(seed=7)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
             "mask": np.ones(ids.shape, np.float32)}
    expected = {d: raw(model, trainable + statistics) for d in (25 / 26, 0.992, 0.0)}  # the statistics' decay
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=True)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        average.update()
        now = raw(model, trainable + statistics)
        expected = {d: next_average(e, now, statistics, 0.992, d) for d, e in expected.items()}
    got = averages_of(model, average)
    assert_same(got, expected[25 / 26])
    for wrong in (0.992, 0.0):
        assert max(np.abs(got[i] - expected[wrong][i]).max() for i in statistics) > 1e-4, wrong


def test_a_resumed_run_restores_the_average_and_one_without_starts_it_from_its_weights(
        averaged, trained_model_dir, tmp_path, caplog):
    import dataclasses

    from captioning.model.folder import ModelDir
    from captioning.experiment import for_training
    from captioning.train import Trainer

    caplog.set_level(logging.INFO, logger="captioning.train")
    folder = str(tmp_path / "resumed")
    shutil.copytree(averaged["folder"], folder)
    trainer = Trainer(for_training(dataclasses.replace(averaged["cfg"], train=dataclasses.replace(averaged["cfg"].train, steps=6))),
                      folder)
    trainer.folder.release()
    assert_same(averaged_of(trainer), averaged["average"][4], rtol=0)
    assert "resumed the weight average (train.ema_decay 0.5) from ckpt-4" in caplog.text

    # train.ema_decay turned on for a folder trained without it: the average starts from the restored weights
    cfg = ModelDir(trained_model_dir).read_config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, ema_decay=0.9))
    later = Trainer(for_training(cfg), trained_model_dir)
    later.folder.release()
    assert later.current_step() == 60
    assert_same(averaged_of(later), raw(later.model, averaged_positions(later.model)), rtol=0)
    assert "ckpt-60 holds no weight average: train.ema_decay's average starts from its weights" in caplog.text


def averaged_of(trainer):
    return averages(trainer)


def rewritten(averaged, folder, averages):
    """A copy of ``averaged``'s folder in ``folder`` whose ckpt-4 holds the same model, optimizer and step, and
    as its average what ``averages(trainer, holder's averages)`` returns ({key: variable})."""
    import tensorflow as tf

    from captioning.model.checkpoints import AVERAGE
    from captioning.experiment import for_training
    from captioning.train import Trainer

    shutil.copytree(averaged["folder"], folder)
    trainer = Trainer(for_training(averaged["cfg"]), folder)  # resumed from ckpt-4: the weights, optimizer, step and average
    trainer.folder.release()
    holder = tf.Module()
    holder.averages = averages(trainer, dict(trainer.average.holder.averages))
    for name in os.listdir(folder):
        if name.startswith("ckpt-4."):
            os.remove(os.path.join(folder, name))
    checkpoint = tf.train.Checkpoint(model=trainer.model, optimizer=trainer.optimizer, step=trainer.step,
                                     **{AVERAGE: holder})
    checkpoint.save_counter.assign(3)  # as the run's manager saves it: ckpt-4, its save counter with it
    assert checkpoint.save(os.path.join(folder, "ckpt")).endswith("ckpt-4")
    return folder


@pytest.fixture(scope="module")
def older(averaged, tmp_path_factory):
    """What a checkpoint written before the batch-norm statistics were averaged held: the trainable weights'
    average only."""
    keep = {str(i) for i in averaged["trainable"]}
    return rewritten(averaged, str(tmp_path_factory.mktemp("ema-older") / "m"),
                     lambda trainer, held: {key: average for key, average in held.items() if key in keep})


def test_a_checkpoint_whose_average_has_no_statistics_loads_and_resumes(averaged, older, caplog):
    """Such a checkpoint (written before the statistics were averaged): ``--weights ema`` puts in the average of
    the trainable weights and keeps the raw statistics, as before; a run resumed from it restores that average
    and starts the statistics' from their restored values, and says how many."""
    import dataclasses

    from captioning.model.folder import ModelDir
    from captioning.experiment import for_training
    from captioning.train import Trainer

    trainable, statistics = averaged["trainable"], averaged["statistics"]
    average, weights = averaged["average"][4], averaged["raw"][4]
    assert sorted(checkpoint_averages(os.path.join(older, "ckpt-4"))) == sorted(trainable)
    loaded = ModelDir(older).load()
    assert loaded.weights == "ema"
    assert_same(raw(loaded.model, trainable), {i: average[i] for i in trainable}, rtol=0)
    assert_same(raw(loaded.model, statistics), {i: weights[i] for i in statistics}, rtol=0)
    caplog.set_level(logging.INFO, logger="captioning.train")
    cfg = averaged["cfg"]
    trainer = Trainer(for_training(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6))), older)
    trainer.folder.release()
    got = averaged_of(trainer)
    assert_same({i: got[i] for i in trainable}, {i: average[i] for i in trainable}, rtol=0)
    assert_same({i: got[i] for i in statistics}, {i: weights[i] for i in statistics}, rtol=0)
    assert ("resumed the weight average (train.ema_decay 0.5) from ckpt-4; 10 weights or statistics without one "
            "there start from their values") in caplog.text


@pytest.mark.slow
def test_steps_per_execution_and_loss_scaling_update_the_average_at_each_applied_step(averaged, tmp_path):
    """A resumed run of 2 steps from ckpt-4 in one call (train.steps_per_execution: 2) ends with the average of
    the same 2 steps taken one call each on the fixture's Trainer with its traced single step (ckpt-4 restored
    into it, the run's 2 batches: the stream past its first 4, which a resumed run replays under
    data.deterministic), the one recomputed from the weights after each.

    Then, on the fixture's Trainer: Keras' LossScaleOptimizer (mixed_float16 on a GPU) skips non-finite
    gradients by itself: the step asks it (check_finite), so the average moves exactly when its iterations do:
    not at a non-finite batch, whatever the huge scale does at the next, and at a step of scale 1."""
    import dataclasses

    import keras
    import tensorflow as tf

    from captioning.experiment import for_training
    from captioning.train import Trainer
    from captioning.train.steps import make_train_step

    folder = str(tmp_path / "k2")
    shutil.copytree(averaged["folder"], folder)
    train = dataclasses.replace(averaged["cfg"].train, steps=6, steps_per_execution=2)
    data = dataclasses.replace(averaged["cfg"].data, random_crop=False)  # the same crops in the run and by hand
    trainer = Trainer(for_training(dataclasses.replace(averaged["cfg"], train=train, data=data)), folder)
    batches = iter(trainer.distributed_dataset("train", training=True))  # the run's (at step 4; no random crops)
    assert trainer.run(progress=False)["step"] == 6
    in_one_call = checkpoint_averages(os.path.join(folder, "ckpt-6"))
    trainer.folder.release()
    # the single steps on the fixture's Trainer: its step is traced already (for batches of this element_spec)
    trainer, single = averaged["trainer"], averaged["step"]
    trainer.checkpoint.restore(os.path.join(averaged["folder"], "ckpt-4")).expect_partial()  # its average too
    assert_same(averages(trainer), averaged["average"][4], rtol=0)
    expected = averaged["average"][4]
    for _ in (5, 6):  # one step a call
        single(next(batches))
        expected = next_average(expected, raw(trainer.model, averaged["positions"]), averaged["statistics"])
    assert trainer.current_step() == 6 and single.experimental_get_tracing_count() == 1  # not traced again
    assert_same(averages(trainer), expected)
    assert_same(in_one_call, averages(trainer), rtol=1e-4)

    # loss scaling, on the same Trainer (its average and weights those after the single steps)
    with trainer.strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=2.0 ** 127)
        optimizer.build(trainer.model.trainable_variables)
    step = tf.function(make_train_step(trainer.model, optimizer, trainer.strategy, trainer.objective, trainer.step,
                                       0.0, False, after_update=trainer.average.after_update), autograph=False)
    batches = iter(trainer.distributed_dataset("train", training=True))
    positions, trainable = averaged_positions(trainer.model), trainable_positions(trainer.model)
    expected, weights, applied = averages(trainer), raw(trainer.model, positions), []
    for number in range(3):
        batch = next(batches)
        if number == 0:
            batch = {**batch, "mask": batch["mask"] * float("nan")}
        if number == 2:
            optimizer.dynamic_scale.assign(1.0)
        iterations = int(optimizer.iterations.numpy())
        step(batch)
        applied.append(int(optimizer.iterations.numpy()) > iterations)
        after = raw(trainer.model, positions)
        assert applied[-1] == any(not np.array_equal(after[i], weights[i]) for i in trainable)
        if applied[-1]:
            expected = next_average(expected, after, averaged["statistics"])
        assert_same(averages(trainer), expected, rtol=0 if not applied[-1] else 1e-6)
        weights = after
    assert applied[0] is False and applied[2] is True


def caption_json(folder, images, *flags):
    result = run_cli("caption", "--model-dir", folder, *images, "--json", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr


@pytest.mark.slow
def test_weights_ema_by_default_raw_on_request_in_load_caption_and_export(averaged, trained_model_dir, shapes_dir,
                                                                          tmp_path):
    import tensorflow as tf

    from captioning.model.folder import ModelDir

    folder, positions = averaged["folder"], averaged["positions"]
    average, weights = averaged["average"][4], averaged["raw"][4]
    default, as_raw = ModelDir(folder).load(), ModelDir(folder).load(weights="raw")
    assert (default.weights, as_raw.weights) == ("ema", "raw")
    assert_same(raw(default.model, positions), average, rtol=0)
    assert_same(raw(as_raw.model, positions), weights, rtol=0)

    images = [os.path.join(shapes_dir, "images", name) for name in sorted(os.listdir(os.path.join(shapes_dir,
                                                                                                   "images")))[:2]]
    by_default, logged = caption_json(folder, images)
    assert "using the weight average (train.ema_decay) of ckpt-4" in logged
    assert caption_json(folder, images, "--weights", "ema")[0] == by_default
    raw_captions = caption_json(folder, images, "--weights", "raw")[0]
    log_probs = [[c["log_prob"] for c in image["captions"]] for image in by_default]
    raw_log_probs = [[c["log_prob"] for c in image["captions"]] for image in raw_captions]
    assert not np.allclose(log_probs, raw_log_probs, atol=1e-3)  # other weights, other probabilities

    # a folder trained without an average: --weights ema is one line, exit 2; the default is its raw weights
    refused = run_cli("caption", "--model-dir", trained_model_dir, images[0], "--weights", "ema")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "holds no weight average" in errors[0] and "--weights raw" in errors[0], errors
    assert ModelDir(trained_model_dir).load().weights == "raw"

    # the SavedModel holds the average (and its marker says so); --weights raw exports the raw weights
    for chosen, values, other in (("ema", average, weights), ("raw", weights, average)):
        output = str(tmp_path / f"export-{chosen}")
        flags = ("--weights", "raw") if chosen == "raw" else ()
        result = run_cli("export", "--model-dir", folder, "--output", output, *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.load(open(os.path.join(output, "captioning_export.json")))["weights"] == chosen
        reader = tf.train.load_checkpoint(os.path.join(output, "variables", "variables"))
        saved = [np.asarray(reader.get_tensor(name)) for name in reader.get_variable_to_shape_map()]
        for i in positions:
            assert any(s.shape == values[i].shape and np.array_equal(s, values[i]) for s in saved), i
        moved = [i for i in positions if not np.array_equal(values[i], other[i])]
        assert moved and not any(any(s.shape == other[i].shape and np.array_equal(s, other[i]) for s in saved)
                                 for i in moved)


@pytest.mark.slow
def test_evaluate_keeps_the_average_and_the_raw_weights_as_two_results(averaged):
    from captioning.evaluation.evaluate import evaluate

    folder = averaged["folder"]
    ema = evaluate(folder, split="test", beam_size=1, max_images=2, progress=False)
    raw_result = evaluate(folder, split="test", beam_size=1, max_images=2, progress=False, weights="raw")
    assert (ema["weights"], raw_result["weights"]) == ("ema", "raw")
    assert ema.perplexity != pytest.approx(raw_result.perplexity, rel=1e-6)
    stored = [name for name in os.listdir(os.path.join(folder, "eval")) if not name.endswith("predictions.json")]
    assert sorted(name.split("-first2")[0] for name in stored) == [
        "test-step4-beam1-len20-norm0", "test-step4-beam1-len20-norm0-ema"], stored
    again = evaluate(folder, split="test", beam_size=1, max_images=2, progress=False, weights="ema")  # stored: as is
    assert again.perplexity == ema.perplexity


@pytest.mark.slow
def test_evaluate_with_the_average_reads_the_statistics_average(averaged, tmp_path):
    """A copy whose checkpoint's average holds the statistics the run started from (as a slow average would)
    in place of the saved ones: ``evaluate --weights ema`` gives another perplexity there, the raw weights
    the same one (the copy differs in nothing else)."""
    from captioning.evaluation.evaluate import evaluate

    start = {str(i): averaged["raw"][0][i] for i in averaged["statistics"]}

    def initial_statistics(trainer, held):
        for key, value in start.items():
            held[key].assign(value)
        return held

    other = rewritten(averaged, str(tmp_path / "m"), initial_statistics)
    saved = checkpoint_averages(os.path.join(other, "ckpt-4"))
    assert_same({i: saved[i] for i in averaged["statistics"]}, {int(k): v for k, v in start.items()}, rtol=0)

    def perplexity(folder, weights):
        return evaluate(folder, split="test", beam_size=1, max_images=2, progress=False, weights=weights).perplexity

    assert perplexity(other, "raw") == perplexity(averaged["folder"], "raw")
    assert perplexity(other, "ema") != pytest.approx(perplexity(averaged["folder"], "ema"), rel=1e-6)


@pytest.mark.slow
def test_two_replicas_keep_identical_averages_equal_to_one_replicas(mirrored_contracts):
    """3 steps from the same weights on one device and on 2 mirrored replicas: the decoder contract's run of
    show_and_tell (conftest's mirrored_contracts, tests/distributed_worker.py's mirrored with ``average``)."""
    out = contract_result(mirrored_contracts, "decoders", AVERAGED)
    count = len([k for k in out.files if k.startswith("two_copies_")])
    assert count > 5
    moved = 0
    for k in range(count):
        copies, single = out[f"two_copies_{k}"], out[f"one_copies_{k}"]
        assert copies.shape[0] == 2 and single.shape[0] == 1
        np.testing.assert_array_equal(copies[0], copies[1])  # every replica's copy, bit for bit
        np.testing.assert_allclose(copies[0], single[0], rtol=1e-5, atol=1e-6)  # one replica's, to float rounding
        moved += not np.allclose(copies[0], out[f"two_weight_{k}"])
    assert moved > count // 2  # an average, not the weights
