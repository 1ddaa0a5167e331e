"""The objective contract: what every registered training objective must do, run over
captioning.train.objectives.OBJECTIVES (a new objective is tested by these with no new test code)."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import DataConfig, load_config
from captioning.errors import InputError
from captioning.train.objectives import OBJECTIVES, Objective, fit_config
from tests.helpers import small_train_config

NAMES = sorted(OBJECTIVES)


def _other(field: dataclasses.Field, value):
    """A valid value of the data setting ``field`` other than ``value``."""
    if "choices" in field.metadata:
        return next(c for c in field.metadata["choices"] if c != value)
    return value + 1


@pytest.mark.parametrize("name", NAMES)
def test_an_objective_declares_what_the_loop_asks(name):
    cls = OBJECTIVES[name]
    assert issubclass(cls, Objective) and cls.name == name
    assert set(cls.needs) <= {f.name for f in dataclasses.fields(DataConfig)}
    assert isinstance(cls.parts, tuple) and all(isinstance(p, str) and p for p in cls.parts)
    assert isinstance(cls.xla, bool)
    for hook in ("for_run", "replica_loss"):
        assert getattr(cls, hook) is not getattr(Objective, hook), f"{name} does not implement {hook}"


@pytest.mark.parametrize("name", NAMES)
def test_choosing_it_brings_the_batches_it_needs_and_refuses_a_contradiction(name):
    cls = OBJECTIVES[name]
    cfg = fit_config(load_config(None, [f"train.objective={name}"]))
    assert {key: getattr(cfg.data, key) for key in cls.needs} == cls.needs
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for key, wanted in cls.needs.items():
        rest = [f"data.{k}={v}" for k, v in cls.needs.items() if k != key]  # the others as needed
        contrary = f"data.{key}={_other(fields[key], wanted)}"
        with pytest.raises(InputError, match=f"train.objective: {name} needs data.{key}"):
            fit_config(load_config(None, [f"train.objective={name}", *rest, contrary]))
    jit = ["train.jit_compile=true", "data.bucket_boundaries=[6,10]"]
    if cls.xla:
        assert fit_config(load_config(None, [f"train.objective={name}", *jit])).train.jit_compile
    else:
        with pytest.raises(InputError, match=f"train.jit_compile does not apply to train.objective: {name}"):
            fit_config(load_config(None, [f"train.objective={name}", *jit]))


def test_each_objective_with_settings_has_its_config_section_and_no_other_does():
    """An objective's settings are the config section named after it: the loader keeps exactly one section as
    given (a Config field holding a ComponentSection) for each objective that declares a settings_class, and
    each such class is a Section dataclass whose every key has a default."""
    from captioning.config import COMPONENT_SECTIONS, ComponentSection, Config
    from captioning.config.settings import Section

    with_settings = {name for name, cls in OBJECTIVES.items() if cls.settings_class is not None}
    assert set(COMPONENT_SECTIONS) == with_settings == {"scst"}
    for name in with_settings:
        cls = OBJECTIVES[name].settings_class
        assert issubclass(cls, Section) and isinstance(getattr(Config(), name), ComponentSection)
        assert all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                   for f in dataclasses.fields(cls))


def test_the_loader_keeps_an_objectives_section_as_given_and_the_training_stage_types_it():
    """``scst:`` is read by the loader without the objective's class (so the config loads before TensorFlow),
    then typed with the same engine as every key, whichever objective the run trains with."""
    from captioning.config import to_dict
    from captioning.config.settings import Given
    from captioning.train.objectives import resolve
    from captioning.train.objectives.scst import ScstSettings

    given = load_config(None, ["scst.samples=3", "scst.end_in_reward=no", "scst.bogus=1"])
    assert dict(given.scst) == {"samples": Given("3"), "end_in_reward": Given("no"), "bogus": Given("1")}
    with pytest.raises(AttributeError, match="not typed yet"):
        given.scst.samples
    with pytest.raises(InputError) as info:
        fit_config(given)  # train.objective: xe, and still refused
    assert str(info.value) == ("unknown config key 'scst.bogus'; did you mean scst.baseline, scst.samples, "
                               "scst.xe_weight?")
    typed = resolve(load_config(None, ["scst.samples=3", "scst.end_in_reward=no"]))
    assert typed.scst == ScstSettings(samples=3, end_in_reward=False) and resolve(typed) is typed
    assert to_dict(typed)["scst"] == {"samples": 3, "baseline": "mean", "max_length": 16, "temperature": 1.0,
                                      "end_in_reward": False, "xla_sampling": True, "xe_weight": 0.0,
                                      "reward": "cider", "clip_preset": "", "clip_weight": 1.0}
    for override, message in (("scst.samplez=3", "unknown config key 'scst.samplez'; did you mean scst.samples"),
                              ("scst.samples=three", "config key scst.samples must be an integer, got 'three'"),
                              ("scst.samples=51", "config key scst.samples must be in [1, 50], got 51"),
                              ("scst.baseline=best", "config key scst.baseline must be one of mean, greedy, got "
                                                     "'best'")):
        with pytest.raises(InputError) as info:
            resolve(load_config(None, [override]))
        assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("override, said", [
    ("scst.bogus=1", "unknown config key 'scst.bogus'; did you mean scst.baseline, scst.samples, scst.xe_weight?"),
    ("scst.max_length=101", "config key scst.max_length must be in [1, 100], got 101"),
    ("scst.temperature=warm", "config key scst.temperature must be a number, got 'warm'"),
])
def test_a_bad_scst_setting_stops_train_in_one_line_before_anything_is_written(override, said, tmp_path):
    from tests.helpers import REPO, run_main

    code, out, err = run_main("train", "--config", os.path.join(REPO, "experiments", "shapes_scst.yaml"),
                              "--model-dir", tmp_path / "m", "--set", override)
    assert code == 2 and err.strip().splitlines()[-1] == f"captioning train: error: {said}", err
    assert not (tmp_path / "m").exists()


def test_the_scst_switch_of_every_experiment_is_what_docs_decoders_says():
    """docs/decoders.md: `--set train.objective=scst` alone switches every cross-entropy config of experiments/
    (a config's train.jit_compile: true is turned off for the run) but those it names as needing
    `--set data.group_captions=0`, which switch with it."""
    import glob
    import os
    import re

    from captioning.model import resolve
    from tests.helpers import REPO

    text = " ".join(open(os.path.join(REPO, "docs", "decoders.md"), encoding="utf-8").read().split())
    sentence = re.search(r"The COCO recipes that group captions, (.*?) also need `--set data.group_captions=0`", text)
    named = set(re.findall(r"`(experiments/\w+\.yaml)`", sentence.group(1)))
    refused, jit_turned_off = set(), set()
    for path in sorted(glob.glob(os.path.join(REPO, "experiments", "*.yaml"))):
        name = os.path.relpath(path, REPO)
        if load_config(path).train.objective != "xe":
            continue
        try:
            cfg = fit_config(resolve(load_config(path, ["train.objective=scst"])))
        except InputError as e:
            assert "needs data.group_captions: 0" in str(e), (name, str(e))
            refused.add(name)
            cfg = fit_config(resolve(load_config(path, ["train.objective=scst", "data.group_captions=0"])))
        assert cfg.train.objective == "scst" and not cfg.train.jit_compile
        if load_config(path).train.jit_compile:
            jit_turned_off.add(name)
    assert refused == named == {"experiments/transformer_coco.yaml", "experiments/updown_coco.yaml"}
    assert "experiments/scenes_updown.yaml" in jit_turned_off  # the config the docs name
    with pytest.raises(InputError, match="train.jit_compile does not apply to train.objective: scst"):
        fit_config(resolve(load_config(os.path.join(REPO, "experiments", "scenes_updown.yaml"),
                                       ["train.objective=scst", "train.jit_compile=true"])))


@pytest.fixture(scope="module")
def trained(prepared_dir, tmp_path_factory):
    """Each objective's trainer after 3 steps of a tiny model, with its weights before them."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    runs = {}
    for name in NAMES:
        cfg = small_train_config(prepared_dir, f"train.objective={name}", "train.steps=3", "train.batch_size=10",
                                 "train.optimizer=adam", "train.learning_rate=0.01", "scst.samples=2",
                                 "scst.max_length=20")
        trainer = Trainer(for_training(fit_config(cfg)), str(tmp_path_factory.mktemp(name)))
        before = [v.numpy() for v in trainer.model.trainable_variables]
        result = trainer.run(progress=False)
        runs[name] = trainer, before, result
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_few_steps_move_the_weights_and_report_the_declared_parts(name, trained):
    trainer, before, result = trained[name]
    assert len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    moved = [not np.array_equal(a, v.numpy()) for a, v in zip(before, trainer.model.trainable_variables)]
    assert sum(moved) > len(moved) // 2
    # the run's own training batches: the step compiled for them during the run (traced once, not again)
    dataset = trainer.distributed_dataset(trainer.cfg.data.train_split, training=True)
    out = trainer.train_step_for(dataset)(next(iter(dataset)))
    assert {"loss", "gradient_norm", "weight"} <= set(out) and set(OBJECTIVES[name].parts) <= set(out)
    assert np.isfinite(float(out["loss"])) and float(out["weight"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_replica_with_no_example_adds_nothing(name, trained):
    """Under a strategy the last batch may leave a replica empty: its loss sum, weight and gradients are 0. Checked
    on the run's own training step (traced for the dataset's batches, whose batch dimension is unknown, during the
    run: not traced again) given a batch of no example: the loss reported is the loss sum (divided by at most 1),
    the sums too, and a global gradient norm of 0 is every gradient 0 (the step's gradients are dense: a variable
    the loss does not reach has a gradient of zeros)."""
    trainer = trained[name][0]
    dataset = trainer.distributed_dataset(trainer.cfg.data.train_split, training=True)
    empty = tf.nest.map_structure(lambda t: t[:0], next(iter(dataset)))
    step = trainer.train_step_for(dataset)
    out = step(empty)
    assert step.experimental_get_tracing_count() == 1  # the run's trace
    assert float(out["loss"]) == 0.0 and float(out["weight"]) == 0.0
    assert set(OBJECTIVES[name].parts) <= set(out) and all(np.isfinite(float(v)) for v in out.values())
    assert float(out["gradient_norm"]) == 0.0
