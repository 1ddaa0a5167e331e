"""The training kit Transformers need: the noam schedule, AdamW's decoupled weight decay, label smoothing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import load_config
from captioning.errors import InputError
from captioning.train.optimizer import LearningRate, make_optimizer
from tests.helpers import model_config, small_train_config


def test_noam_rises_linearly_then_falls_as_the_inverse_square_root():
    peak = (512 * 20_000) ** -0.5  # 3.125e-4: self-critical.pytorch's NoamOpt(512, factor 1, warmup 20000)
    noam = LearningRate(peak, "noam", decay_steps=1, factor=0.5, total_steps=10**6, warmup_steps=20_000)
    rates = {step: float(noam(step - 1)) for step in (1, 10_000, 20_000, 80_000, 320_000)}  # the step-th update
    assert rates[20_000] == pytest.approx(peak, rel=1e-6)  # the peak, at the end of the warm-up
    assert rates[10_000] == pytest.approx(peak / 2, rel=1e-5) and rates[80_000] == pytest.approx(peak / 2, rel=1e-5)
    for step, rate in rates.items():  # NoamOpt's d_model^-0.5 · min(s^-0.5, s · w^-1.5), step by step
        assert rate == pytest.approx(512 ** -0.5 * min(step ** -0.5, step * 20_000 ** -1.5), rel=1e-5)
    with pytest.raises(InputError, match="train.lr_schedule: noam rises over train.warmup_steps, which must be at "
                                         "least 1, got 0"):
        load_config(None, ["train.lr_schedule=noam"])


def test_adamw_decays_the_weights_by_the_rate_times_the_decay():
    cfg = load_config(None, ["train.optimizer=adamw", "train.weight_decay=0.1", "train.learning_rate=0.5",
                             "train.lr_schedule=constant"]).train
    optimizer = make_optimizer(cfg, steps_per_epoch=10, mixed_float16=False)
    variable = tf.Variable([2.0, -4.0])
    optimizer.build([variable])
    optimizer.apply([tf.zeros(2)], [variable])  # no gradient: only the decay moves it
    np.testing.assert_allclose(variable.numpy(), np.array([2.0, -4.0]) * (1 - 0.5 * 0.1), rtol=1e-6)
    assert isinstance(make_optimizer(load_config(None, ["train.optimizer=adam"]).train, 10, False), keras.optimizers.Adam)


def test_label_smoothing_is_the_smoothed_cross_entropy_and_perplexity_stays_plain():
    from captioning.model import build_model
    from captioning.train.objectives import caption_loss_sum

    model = build_model(30, model_config(encoder="small_cnn", embedding_size=8, lstm_units=8, dropout=0.0), 32).build_all()
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 30, (3, 6)).astype(np.int64)
    mask = np.ones((3, 6), np.float32)
    mask[2, 3:] = 0
    batch = {"image": rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), "input_ids": ids,
             "target_ids": np.roll(ids, -1, axis=1), "mask": mask}
    plain, _, same = caption_loss_sum(model, batch, parts=True)
    assert float(same) == pytest.approx(float(plain))
    ce, _, smoothed = caption_loss_sum(model, batch, parts=True, label_smoothing=0.1)
    logp = tf.nn.log_softmax(model({"image": batch["image"], "input_ids": ids})).numpy()
    picked = np.take_along_axis(logp, batch["target_ids"][..., None], axis=-1)[..., 0]
    expected = ((0.9 * -picked + 0.1 * -logp.mean(axis=-1)) * mask).sum()
    assert float(smoothed) == pytest.approx(expected, rel=1e-5) and float(ce) == pytest.approx(float(plain))
    assert float(caption_loss_sum(model, batch, label_smoothing=0.1)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_transformer_trains_with_the_kit(prepared_dir, tmp_path):
    """noam, AdamW and label smoothing together through the training loop: the loss it minimises is the
    smoothed one, above the plain cross-entropy it reports for perplexity."""
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "model.decoder=transformer", "model.d_model=16", "model.heads=2",
                             "model.ff_size=24", "model.encoder_layers=1", "model.decoder_layers=2",
                             "train.optimizer=adamw", "train.lr_schedule=noam", "train.warmup_steps=4",
                             "train.learning_rate=0.003", "train.label_smoothing=0.1", "train.steps=12")
    trainer = Trainer(cfg, str(tmp_path / "m"))
    assert type(trainer.optimizer).__name__ == "AdamW"
    result = trainer.run(progress=False)
    assert result.step == 12 and np.isfinite(result.losses).all()
    assert np.mean(result.losses[-4:]) < np.mean(result.losses[:4])
