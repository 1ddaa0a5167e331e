"""The weight average's checks (``train.ema_decay``, captioning.train.ema), shared by tests/test_ema.py and
tests/test_accumulate.py: which of a model's variables it covers, its values in a Trainer and in a checkpoint, and one
step of it recomputed in numpy."""

import numpy as np

from tests.harness.scenarios import DECAY


def trainable_positions(model) -> list[int]:
    """Each trainable weight's position in ``model.variables`` (the average's key in the checkpoint)."""
    position = {id(v): i for i, v in enumerate(model.variables)}
    return [position[id(v)] for v in model.trainable_variables]


def statistics_positions(model) -> list[int]:
    """The batch-norm layers' moving statistics' positions in ``model.variables``, found by their names."""
    return [i for i, v in enumerate(model.variables) if v.name in ("moving_mean", "moving_variance")]


def averaged_positions(model) -> list[int]:
    """What the average covers here (the encoder trains): the trainable weights and the moving statistics."""
    return trainable_positions(model) + statistics_positions(model)


def averages_of(model, average) -> dict[int, np.ndarray]:
    position = {id(v): i for i, v in enumerate(model.variables)}
    return {position[id(v)]: a.numpy() for v, a in average.pairs}


def averages(trainer) -> dict[int, np.ndarray]:
    return averages_of(trainer.model, trainer.average)


def raw(model, positions) -> dict[int, np.ndarray]:
    return {i: model.variables[i].numpy() for i in positions}


def checkpoint_averages(path) -> dict[int, np.ndarray]:
    import tensorflow as tf

    from captioning.model.checkpoints import CheckpointFiles

    reader = tf.train.load_checkpoint(path)
    return {i: reader.get_tensor(name) for i, name in CheckpointFiles.averaged(path).items()}


def next_average(average: dict, weights: dict, statistics=(), decay=DECAY, statistics_decay=0.0) -> dict:
    """One step of the average, in numpy: d × average + (1 − d) × weight, in float32; the positions
    ``statistics`` (batch-norm moving statistics) at ``statistics_decay``. At DECAY 0.5 that is 0, their raw
    values: their own delay (Keras' momentum 0.99: 99 steps) is longer than the average's (1 step)."""
    def step(i):
        d = np.float32(statistics_decay if i in statistics else decay)
        return d * average[i] + (np.float32(1) - d) * weights[i]
    return {i: step(i) for i in average}


def assert_same(got: dict, want: dict, rtol=1e-6):
    assert got.keys() == want.keys()
    for i in want:
        np.testing.assert_allclose(got[i], want[i], rtol=rtol, atol=1e-7, err_msg=f"weight {i}")
