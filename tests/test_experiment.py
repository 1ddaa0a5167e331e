"""The composition root (captioning.experiment): a config typed once, fitted for training, and handed to the
stages, which never type it again (docs/architecture.md, "How a setting travels")."""

import ast
import dataclasses
import os

import pytest

from captioning import config as config_lib
from captioning.errors import InputError
from tests.helpers import REPO, small_train_config

PACKAGE = os.path.join(REPO, "captioning")


def test_an_experiment_types_every_component_once_and_hands_out_the_pieces(prepared_dir):
    from captioning.experiment import for_training
    from captioning.model.show_and_tell import ShowAndTellSettings
    from captioning.train.objectives.scst import ScstSettings, SelfCritical

    cfg = small_train_config(prepared_dir, "train.objective=scst", "model.lstm_units=20", "scst.samples=3")
    assert cfg.model.options["lstm_units"].text == "20" and not cfg.model.typed  # as --set gave it
    experiment = for_training(cfg)
    model = experiment.config.model
    assert model.options == {} and isinstance(model.decoder_settings, ShowAndTellSettings)
    assert experiment.decoder.settings.lstm_units == 20 and experiment.decoder.name == "show_and_tell"
    assert experiment.encoder.name == "small_cnn" and experiment.encoder.settings is model.encoder_settings
    assert experiment.objective.cls is SelfCritical and isinstance(experiment.objective.settings, ScstSettings)
    assert experiment.objective.settings.samples == 3
    assert experiment.config.data.captions_per_image == "grouped"  # what SCST needs, brought in once
    assert experiment.decoding is experiment.config.decode and experiment.dataset.path == prepared_dir
    # where each key came from travels with every copy (a real field, no attribute set behind the dataclass)
    assert experiment.config.given("model.lstm_units") == "set" and cfg.given("model.lstm_units") == "set"
    assert dataclasses.replace(cfg, train=cfg.train).given("scst.samples") == "set"
    # the record is what config.yaml keeps, and it loads back as the same experiment
    record = experiment.record()
    assert record["model"]["lstm_units"] == 20 and record["scst"]["samples"] == 3
    assert record == config_lib.to_dict(config_lib.with_absolute_paths(experiment.config))


def test_a_trainer_takes_the_experiment_and_types_nothing_again(prepared_dir, tmp_path, monkeypatch):
    """Every typing and fitting function the experiment calls is made to fail once it is built: the trainer
    builds its model, optimizer and folder from the pieces alone."""
    import captioning.config.settings as settings_lib
    import captioning.model as model_lib
    import captioning.model.encoders.base as encoder_base
    import captioning.train.objectives as objectives_lib
    from captioning.experiment import for_training
    from captioning.train import Trainer

    experiment = for_training(small_train_config(prepared_dir, "train.steps=1", "train.eval_every_steps=0"))

    def typed_again(*args, **kwargs):
        raise AssertionError("a stage typed the config again")

    for module, name in ((model_lib, "_typed"), (model_lib, "check_read"), (objectives_lib, "fit_config"),
                         (objectives_lib, "section_from"), (settings_lib, "section_from"), (encoder_base, "section_from")):
        monkeypatch.setattr(module, name, typed_again)
    trainer = Trainer(experiment, str(tmp_path / "m"))
    trainer.folder.release()
    assert trainer.cfg is experiment.config and trainer.model.settings is experiment.decoder.settings


def test_a_key_no_chosen_component_reads_is_refused_when_the_experiment_is_built(prepared_dir):
    from captioning.experiment import typed

    with pytest.raises(InputError, match="model.attention_size is read by the attention and updown decoders, not show_and_tell"):
        typed(small_train_config(prepared_dir, "model.attention_size=8"))


def _calls(name: str) -> list[str]:
    """The modules of captioning/ that call ``name`` (as ``name(...)`` or ``x.name(...)``)."""
    out = []
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(root, file)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if called == name:
                        out.append(os.path.relpath(path, PACKAGE))
    return sorted(set(out))


def test_the_components_keys_are_typed_in_one_place():
    """A component's keys are typed where its registry is asked (the model stage's typed_model, the objectives'
    resolve) and nowhere else; a config is made an experiment by the composition root and the model folder's
    reading only; the caller's given keys travel in Config.provenance, never in an attribute set behind the
    dataclass's back."""
    assert _calls("typed_model") == ["model/__init__.py"]
    assert _calls("fit_config") == ["experiment/__init__.py"]
    # (fit_config types the objectives' sections it is given, a no-op for an experiment's)
    assert _calls("resolve") == ["experiment/__init__.py", "model/folder.py", "train/objectives/__init__.py"]
    # the registries' owners type their components' keys (an encoder built alone, from a model section not typed
    # yet, types its own); the loader types the shared sections with the same engine's convert
    assert _calls("section_from") == ["model/__init__.py", "model/encoders/base.py", "train/objectives/__init__.py"]
    source = "".join(open(os.path.join(root, f), encoding="utf-8").read() for root, _, files in os.walk(PACKAGE)
                     for f in files if f.endswith(".py"))
    assert "_given\"" not in source and "settings_of(" not in source
