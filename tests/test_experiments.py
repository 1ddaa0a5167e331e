"""The shipped experiment configs load, validate, and say what the docs say they say."""

import glob
import os

import pytest

from captioning.config import load_config as load_core, validate
from captioning.model import architecture_diff, resolve
from captioning.model.encoders.small_cnn import SmallCnn
from captioning.train import objectives
from tests.helpers import REPO


def load_config(path):
    """An experiment as training reads it (the decoder's settings and the objectives' sections typed)."""
    return objectives.resolve(resolve(load_core(path)))


def option(c, name):
    return c.model.components[name]

EXPERIMENTS = sorted(glob.glob(os.path.join(REPO, "experiments", "*.yaml")))


def test_the_three_experiments_exist():
    names = {os.path.basename(p) for p in EXPERIMENTS}
    assert {"show_and_tell_coco.yaml", "show_and_tell_coco_finetune.yaml", "shapes.yaml"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=os.path.basename)
def test_every_experiment_loads_and_validates(path):
    validate(load_config(path))


def test_coco_recipe_is_im2txts():
    c = load_config(os.path.join(REPO, "experiments", "show_and_tell_coco.yaml"))
    assert (c.model.encoder, c.model.encoder_trainable, option(c, "embedding_size"), option(c, "lstm_units")) == \
        ("inception_v3", False, 512, 512)
    assert (c.train.batch_size, c.train.optimizer, c.train.learning_rate, c.train.lr_schedule) == (32, "sgd", 2.0, "step")
    assert (c.train.lr_decay_factor, c.train.lr_decay_epochs, c.train.clip_gradient_norm, c.train.steps) == \
        (0.5, 8.0, 5.0, 1_000_000)
    assert (c.data.image_size, c.data.resize_size, c.model.dropout, option(c, "init_scale")) == (299, 346, 0.3, 0.08)


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


def load(name):
    return load_config(os.path.join(REPO, "experiments", name))


def test_attention_configs():
    """The shapes comparison runs both decoders at 64 px (a 4 x 4 grid); the COCO one has the paper's decoder."""
    shapes, plain = load("shapes_attention.yaml"), load("shapes_64.yaml")
    assert shapes.model.decoder == "attention" and plain.model.decoder == "show_and_tell"
    assert shapes.data.image_size == plain.data.image_size == 64 and SmallCnn.map_side(64) == 4
    assert shapes.data.dir == plain.data.dir == load("shapes.yaml").data.dir
    coco = load("show_attend_tell_coco.yaml")
    assert (coco.model.decoder, coco.model.encoder, option(coco, "lstm_units"), option(coco, "attention_size")) == \
        ("attention", "inception_v3", 1000, 512)
    assert option(coco, "attention_l1") == 1.0 and coco.train.optimizer == "adam" and coco.data.cache == "features"


def test_scst_configs_continue_from_cross_entropy():
    for name, base in (("shapes_scst.yaml", "shapes.yaml"), ("show_and_tell_coco_scst.yaml", "show_and_tell_coco.yaml"),
                       ("shapes_attention_scst.yaml", "shapes_attention.yaml")):
        c, xe = load(name), load(base)
        assert c.train.objective == "scst" and xe.train.objective == "xe"
        assert c.data.captions_per_image == "grouped" and c.scst.samples == 5 and c.scst.baseline == "mean"
        assert architecture_diff(xe, c) == []  # --init-from fits
        assert c.data.image_size == xe.data.image_size
        assert not c.model.encoder_trainable and c.scst.max_length == 20  # measured: docs/decoders.md
        assert 4 * c.train.steps == xe.train.steps or name.startswith("show_and_tell")  # a quarter
        assert c.train.optimizer == "adam" and c.train.lr_schedule == "constant"
