"""The shipped experiment configs load, validate, and say what the README says they say."""

import glob
import os

import pytest

from captioning.config import load_config, validate
from tests.conftest import REPO

EXPERIMENTS = sorted(glob.glob(os.path.join(REPO, "experiments", "*.yaml")))


def test_the_three_experiments_exist():
    names = {os.path.basename(p) for p in EXPERIMENTS}
    assert {"show_and_tell_coco.yaml", "show_and_tell_coco_finetune.yaml", "shapes.yaml"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=os.path.basename)
def test_every_experiment_loads_and_validates(path):
    validate(load_config(path))


def test_coco_recipe_is_im2txts():
    c = load_config(os.path.join(REPO, "experiments", "show_and_tell_coco.yaml"))
    assert (c.model.encoder, c.model.encoder_trainable, c.model.embedding_size, c.model.lstm_units) == \
        ("inception_v3", False, 512, 512)
    assert (c.train.batch_size, c.train.optimizer, c.train.learning_rate, c.train.lr_schedule) == (32, "sgd", 2.0, "step")
    assert (c.train.lr_decay_factor, c.train.lr_decay_epochs, c.train.clip_gradient_norm, c.train.steps) == \
        (0.5, 8.0, 5.0, 1_000_000)
    assert (c.data.image_size, c.data.resize_size, c.model.dropout, c.model.init_scale) == (299, 346, 0.3, 0.08)


def test_finetune_inherits_and_trains_the_encoder():
    base = load_config(os.path.join(REPO, "experiments", "show_and_tell_coco.yaml"))
    fine = load_config(os.path.join(REPO, "experiments", "show_and_tell_coco_finetune.yaml"))
    assert fine.model.encoder_trainable and fine.train.learning_rate == 0.0005
    assert fine.train.steps == 3_000_000 and fine.train.lr_schedule == "constant"
    assert (fine.data, fine.distribute) == (base.data, base.distribute)
    assert fine.model.encoder == base.model.encoder and fine.train.batch_size == base.train.batch_size


def test_shapes_is_a_cpu_config():
    c = load_config(os.path.join(REPO, "experiments", "shapes.yaml"))
    assert c.model.encoder == "small_cnn" and c.data.dir == "runs/demo/records" and c.train.optimizer == "sgd"
    assert not c.data.random_flip  # captions name left and right
