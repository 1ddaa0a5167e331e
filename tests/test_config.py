"""Tests for captioning.config: YAML loading, ``base:`` inheritance, ``--set`` overrides and their errors."""

import dataclasses
import datetime
import functools
import math
import os
import shutil
import sys
import tempfile
import typing

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from captioning import model as model_lib
from captioning.config import Config, ModelConfig, TrainConfig, all_keys as core_keys, from_dict, save_config, to_dict
from captioning.config.sections import ScheduledSamplingConfig
from captioning.config import load_config as load_core
from captioning.config.migrations import FORMAT_VERSION as CONFIG_FORMAT
from captioning.errors import InputError
from captioning.config.settings import describe_range, keys_of
from captioning.train import objectives


def load_config(path=None, overrides=(), complete=False):
    """A config as training loads it: the sections of captioning.config, the decoder's own keys typed by
    the model stage and the objectives' sections (scst:) by the training stage."""
    return objectives.resolve(model_lib.resolve(load_core(path, overrides, complete=complete), complete=complete),
                              complete=complete)


# the decoders' own keys, each with the first decoder that declares it; the encoders' with theirs
OWNER = {}
for _name, _cls in model_lib.DECODERS.items():
    for _f in dataclasses.fields(_cls.settings_class):
        OWNER.setdefault(f"model.{_f.name}", _name)
ENCODER_OWNER = {f"model.{_f.name}": _name for _name, _cls in model_lib.ENCODERS.items()
                 for _f in dataclasses.fields(_cls.settings_class)}


OBJECTIVE_KEYS = objectives.all_keys()  # the objectives' own sections (scst.samples, ...)


def all_keys():
    return core_keys() + sorted(set(OWNER) | set(ENCODER_OWNER)) + OBJECTIVE_KEYS  # (vlm_preset: both vlm's)


def section_class(section):
    """The dataclass of a section as training types it (an objective's: its settings_class)."""
    if section in objectives.OBJECTIVES:
        return objectives.OBJECTIVES[section].settings_class
    return type(getattr(Config(), section))


VALID = {"data.service": "localhost:5050", "model.decoder": "attention", "model.encoder": "small_cnn",  # forms
         "decode.bad_endings": ["english", "with"],
         "model.d_model": 1024, "model.heads": 16,  # and keys checked against each other (d_model % heads,
         "decode.beam_groups": 3}  # decode.beam_size % beam_groups)
# keys that apply only beside another setting of their section
COMPANIONS = {"data.group_captions": ["data.captions_per_image=grouped"],
              "train.scheduled_sampling.start": ["train.scheduled_sampling.max=1.0"],
              "decode.jit_compile": ["decode.method=greedy"], "scst.reward": ["scst.clip_preset=runs/clip"]}


def owner(key):
    """The overrides that make ``key`` apply: the decoder or encoder declaring it, or the setting it goes with."""
    if key in ENCODER_OWNER:
        return [f"model.encoder={ENCODER_OWNER[key]}"]
    return [f"model.decoder={OWNER[key]}"] if key in OWNER else COMPANIONS.get(key, [])


@functools.cache
def fields_of(key):
    """The dataclass field of ``key`` and its declared type."""
    section, *path, name = key.split(".")  # a nested section's key: train.scheduled_sampling.max
    cls = (model_lib.DECODERS[OWNER[key]].settings_class if key in OWNER else
           model_lib.ENCODERS[ENCODER_OWNER[key]].settings_class if key in ENCODER_OWNER else section_class(section))
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return next(f for f in dataclasses.fields(cls) if f.name == name), typing.get_type_hints(cls)[name]


def value_of(config, key):
    section, *path, name = key.split(".")
    if key in OWNER or key in ENCODER_OWNER:
        return config.model.components[name]
    owner = getattr(config, section)
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, name)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def load_error(tmp_path, text="", overrides=()):
    """The message of the InputError raised by loading ``text`` (or only ``overrides`` when text is None)."""
    path = write(tmp_path / "c.yaml", text) if text is not None else None
    with pytest.raises(InputError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_without_a_file(tmp_path):
    c = load_config()
    assert c == objectives.resolve(model_lib.resolve(Config())) == load_config(write(tmp_path / "empty.yaml", ""))
    assert (c.train.steps, c.train.learning_rate, c.data.cache) == (1_000_000, 2.0, "none")
    assert (c.model.encoder, c.distribute.strategy) == ("inception_v3", "auto")
    assert c.data.bucket_boundaries == [] and c.data.length_window == 16


def test_file_overrides_keys_in_several_sections_and_keeps_other_defaults(tmp_path):
    path = write(tmp_path / "c.yaml", "data:\n  dir: /data/coco\n  bucket_boundaries: [5, 9]\n"
                 "model:\n  encoder: resnet50\n  dropout: 0\ntrain:\n  steps: 500\n  learning_rate: 2\n"
                 "  mixed_precision: yes\n")
    c = load_config(path)
    assert (c.data.dir, c.data.bucket_boundaries, c.model.encoder) == ("/data/coco", [5, 9], "resnet50")
    assert c.model.dropout == 0.0 and isinstance(c.model.dropout, float)  # an int is accepted for a float
    assert c.train.steps == 500 and c.train.mixed_precision is True
    assert c.train.learning_rate == 2.0 and isinstance(c.train.learning_rate, float)
    assert c.data.image_size == 299 and c.model.components["lstm_units"] == 512 and c.train.batch_size == 32
    assert c.distribute == Config().distribute


def test_child_overrides_base(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  steps: 10\n  batch_size: 8\nmodel:\n  lstm_units: 64\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntrain:\n  steps: 20\n")
    c = load_config(child)
    assert (c.train.steps, c.train.batch_size, c.model.components["lstm_units"]) == (20, 8, 64)


def test_chain_of_three_files_in_different_directories(tmp_path):
    write(tmp_path / "shared" / "grand.yaml", "train:\n  steps: 1\n  batch_size: 2\n  seed: 3\n")
    write(tmp_path / "shared" / "family" / "parent.yaml",
          "base: ../grand.yaml\ntrain:\n  batch_size: 20\nmodel:\n  encoder: small_cnn\n")
    child = write(tmp_path / "experiments" / "child.yaml",
                  "base: ../shared/family/parent.yaml\ntrain:\n  seed: 300\n")
    c = load_config(child)
    assert (c.train.steps, c.train.batch_size, c.train.seed, c.model.encoder) == (1, 20, 300, "small_cnn")


def test_inheritance_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(InputError, match="inherits from itself") as info:
        load_config(str(tmp_path / "a.yaml"))
    assert "a.yaml -> " in str(info.value) and "b.yaml -> " in str(info.value)


@pytest.mark.parametrize("override, section, name, expected", [
    ("train.steps=42", "train", "steps", 42),
    ("train.steps= 7 ", "train", "steps", 7),
    ("train.learning_rate=0.1", "train", "learning_rate", 0.1),
    ("train.learning_rate=5e-4", "train", "learning_rate", 5e-4),
    ("train.learning_rate=3", "train", "learning_rate", 3.0),
    ("model.encoder_weights=/w/x=y.h5", "model", "encoder_weights", "/w/x=y.h5"),  # only the first '=' splits
    ("data.dir=", "data", "dir", ""),
    ("data.bucket_boundaries=[8, 12]", "data", "bucket_boundaries", [8, 12]),
    ("data.bucket_boundaries=8,12", "data", "bucket_boundaries", [8, 12]),
    ("data.bucket_boundaries=[]", "data", "bucket_boundaries", []),
    ("data.bucket_boundaries=", "data", "bucket_boundaries", []),
    ("data.cache=memory", "data", "cache", "memory"),
] + [(f"data.random_flip={t}", "data", "random_flip", True) for t in ("true", "YES", "on", "1", "True")]
  + [(f"data.random_crop={t}", "data", "random_crop", False) for t in ("false", "No", "OFF", "0")])
def test_override_parses_by_type(override, section, name, expected):
    value = getattr(getattr(load_config(overrides=[override]), section), name)
    assert value == expected and type(value) is type(expected)


def test_overrides_win_over_file_and_reach_keys_not_in_file(tmp_path):
    path = write(tmp_path / "c.yaml", "train:\n  steps: 10\n  optimizer: adam\n")
    c = load_config(path, ["train.steps=99", "distribute.strategy=mirrored", "train.steps=100"])
    assert (c.train.steps, c.train.optimizer, c.distribute.strategy) == (100, "adam", "mirrored")


def test_unknown_key_in_file_suggests_close_keys(tmp_path):
    message = load_error(tmp_path, "train:\n  stepz: 10\n")
    assert "unknown config key 'train.stepz'" in message and "train.steps" in message


def test_unknown_section_in_file(tmp_path):
    message = load_error(tmp_path, "trian:\n  steps: 10\n")
    assert "unknown config section 'trian'" in message and "did you mean train?" in message


def test_unknown_key_via_set(tmp_path):
    message = load_error(tmp_path, None, ["model.lstm_unit=3"])
    assert "unknown config key 'model.lstm_unit'" in message and "model.lstm_units" in message
    assert "config key 'train' names a section: give section.key=value, e.g. train.steps=" in load_error(
        tmp_path, None, ["train=3"])


@pytest.mark.parametrize("text, expected", [
    ("train:\n  steps: abc\n", "train.steps must be an integer, got 'abc'"),
    ("train:\n  steps: 1.5\n", "train.steps must be an integer, got 1.5"),
    ("train:\n  steps: true\n", "train.steps must be an integer, got True"),
    ("train:\n  steps: [1]\n", "train.steps must be an integer"),
    ("train:\n  learning_rate: \"x\"\n", "train.learning_rate must be a number, got 'x'"),
    ("train:\n  learning_rate: false\n", "train.learning_rate must be a number"),
    ("data:\n  random_flip: 3\n", "data.random_flip must be a boolean (true/false), got 3"),
    ("data:\n  random_flip: maybe\n", "data.random_flip must be a boolean"),
    ("data:\n  dir: 5\n", "data.dir must be a string, got 5"),
    ("data:\n  bucket_boundaries: [1, x]\n", "data.bucket_boundaries must be a list of integers like [8, 12]"),
    ("data:\n  bucket_boundaries: [1, true]\n", "data.bucket_boundaries must be a list of integers"),
    ("data:\n  bucket_boundaries: 8\n", "data.bucket_boundaries must be a list of integers"),
    ("model:\n  encoder: vgg\n", "model.encoder must be one of inception_v3, resnet50,"),
])
def test_wrong_type_in_file(tmp_path, text, expected):
    assert expected in load_error(tmp_path, text)


@pytest.mark.parametrize("override, expected", [
    ("train.steps=abc", "train.steps must be an integer, got 'abc'"),
    ("train.steps=1.5", "train.steps must be an integer"),
    ("train.learning_rate=fast", "train.learning_rate must be a number"),
    ("data.random_flip=2", "data.random_flip must be a boolean (true/false), got '2'"),
    ("data.bucket_boundaries=8;12", "data.bucket_boundaries must be a list of integers"),
    ("data.cache=foo", "data.cache must be one of none, memory, disk, features, got 'foo'"),
    ("train.steps", "must look like section.key=value"),
])
def test_bad_override(tmp_path, override, expected):
    assert expected in load_error(tmp_path, None, [override])


def test_missing_file_or_base(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_config(str(tmp_path / "absent.yaml"))
    assert "nowhere.yaml does not exist" in load_error(tmp_path, "base: nowhere.yaml\n")


@pytest.mark.parametrize("text, expected", [
    ("train: {steps: 3\n", "is not valid YAML (line 2)"),
    ("train:\n\tsteps: 3\n", "is not valid YAML"),
    ("- train\n- model\n", "must be a mapping of sections, got list"),
    ("just a string\n", "must be a mapping of sections, got str"),
    ("train: 5\n", "section 'train' must be a mapping of keys"),
    ("train: [steps]\n", "section 'train' must be a mapping of keys"),
])
def test_malformed_file(tmp_path, text, expected):
    assert expected in load_error(tmp_path, text)


def test_yaml_cannot_construct_python_objects(tmp_path):
    marker = tmp_path / "executed"
    text = f'train:\n  steps: !!python/object/apply:os.system ["touch {marker}"]\n'
    assert "not valid YAML" in load_error(tmp_path, text)
    assert "not valid YAML" in load_error(tmp_path, f'!!python/object/apply:os.system ["touch {marker}"]\n')
    assert not marker.exists()


def test_save_then_load_gives_equal_config(tmp_path):
    c = load_config(overrides=["train.learning_rate=1e-05", "data.bucket_boundaries=[]", "data.dir=yes",
                               "model.encoder_trainable=true", "distribute.tpu=123", "train.steps=7"])
    path = write(tmp_path / "saved.yaml", "garbage: [\n")  # an existing file is replaced
    save_config(c, path)
    assert load_config(path) == c and load_config(path).distribute.tpu == "123"
    assert not (tmp_path / "saved.yaml.tmp").exists()


def test_from_dict_inverts_to_dict():
    c = load_config(overrides=["model.encoder=mobilenet_v2", "data.bucket_boundaries=3,4", "train.seed=9"])
    d = to_dict(c)
    assert set(d) == {"data", "model", "train", "distribute", "decode", "scst"} and d["train"]["seed"] == 9
    # the components' keys typed by the model stage, scst's by the training stage: every key
    assert objectives.resolve(model_lib.resolve(from_dict(d), complete=True), complete=True) == c
    assert from_dict(to_dict(Config())) == Config()
    with pytest.raises(InputError, match="train.stepz"):
        from_dict({"train": {"stepz": 1}})


def load_or_input_error(override):
    try:
        return load_config(overrides=[override])
    except InputError:
        return None


PROPERTY = settings(max_examples=200, deadline=None, derandomize=True)  # seconds, and the same run on CI


@PROPERTY
@given(st.text())
def test_any_text_for_int_field_gives_int_or_input_error(text):
    c = load_or_input_error(f"train.steps={text}")
    assert c is None or type(c.train.steps) is int


@PROPERTY
@given(st.one_of(st.text(), st.lists(st.integers()).map(lambda v: ",".join(map(str, v)))))
def test_any_text_for_list_field_gives_int_list_or_input_error(text):
    c = load_or_input_error(f"data.bucket_boundaries={text}")
    assert c is None or all(type(v) is int for v in c.data.bucket_boundaries)


@PROPERTY
@given(st.text())
def test_any_text_for_bool_field_gives_bool_or_input_error(text):
    c = load_or_input_error(f"data.random_flip={text}")
    assert c is None or c.data.random_flip is (text.strip().lower() in {"true", "yes", "on", "1"})


def other_value(key):
    """A value for ``key`` of its default's type, different from the default (inside its range)."""
    f, _ = fields_of(key)
    default = value_of(load_config(overrides=owner(key)), key)
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    if key in VALID:
        return VALID[key]
    if "range" in f.metadata and isinstance(default, (int, float)) and not isinstance(default, bool):
        _, _, high, _ = f.metadata["range"]
        if high is not None:  # halfway to the top, inside the range
            return default + 1 if isinstance(default, int) and default + 1 < high else (default + high) / 2
    if isinstance(default, bool):
        return not default
    if isinstance(default, list):
        return default + [99] if default else [1, 2]
    return default + ("x/y" if isinstance(default, str) else 1 if isinstance(default, int) else 0.25)


@pytest.mark.parametrize("key", all_keys())
def test_every_key_can_be_overridden(key):
    value = other_value(key)
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    got = value_of(load_config(overrides=owner(key) + [f"{key}={text}"]), key)
    assert got == value and type(got) is type(value)


NUMERIC = [key for key in all_keys() if "range" in fields_of(key)[0].metadata]


def outside(bounds, kind):
    """Values just outside a field's range (below it, and above it when it has a top)."""
    low, low_open, high, high_open = bounds
    values = [low if low_open else (low - 1 if kind is int else low - 0.5)]
    if high is not None:
        values.append(high if high_open else (high + 1 if kind is int else high + 0.5))
    return values


def test_every_number_declares_its_range():
    kinds = {key: fields_of(key)[1] for key in all_keys()}
    assert [k for k, kind in kinds.items() if kind in (int, float) and k not in NUMERIC] == []


# numbers that are not sizes and need no upper bound: a learning rate (the NaN tests train at 1e30 on purpose)
NOT_SIZES = {"TrainConfig.learning_rate"}


def test_every_number_has_a_finite_upper_bound():
    """Every int or float field of every config section and of every registered decoder's settings (asked of the
    registry, so a new decoder is covered) that has a lower bound has a finite upper bound too: a size typed with
    extra zeros is one line before any work, not a kill for memory (docs/reliability.md, "Upper bounds of
    sizes")."""
    classes = [section_class(name) for name in keys_of(Config)]  # its sections (not where keys came from)
    classes += [kind for cls in list(classes) for kind in typing.get_type_hints(cls).values()
                if isinstance(kind, type) and dataclasses.is_dataclass(kind)]  # nested: train.scheduled_sampling
    classes += [cls.settings_class for cls in [*model_lib.DECODERS.values(), *model_lib.ENCODERS.values()]]
    assert {"DataConfig", "TrainConfig", "ScstSettings", "DistributeConfig", "DecodeConfig", "TransformerSettings"} <= \
        {cls.__name__ for cls in classes}
    checked, unbounded = [], []
    for cls in classes:
        kinds = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            bounds = f.metadata.get("range")
            if kinds[f.name] not in (int, float) or bounds is None or bounds[0] is None:
                continue
            if f"{cls.__name__}.{f.name}" in NOT_SIZES:
                continue
            checked.append(f"{cls.__name__}.{f.name}")
            high = bounds[2]
            if high is None or not math.isfinite(high):
                unbounded.append(f"{cls.__name__}.{f.name}")
    assert unbounded == [] and len(checked) > 50, unbounded


@pytest.mark.parametrize("key, too_big, said", [
    ("data.image_size", 100000, "in [1, 1024]"), ("train.batch_size", 10**6, "in [1, 8192]"),
    ("train.steps", 10**10, "in [1, 1000000000]"), ("scst.max_length", 101, "in [1, 100]"),
    ("distribute.startup_timeout_s", 86401, "in [1, 86400]"), ("model.d_model", 8193, "in [1, 8192]"),
    ("model.decoder_layers", 49, "in [1, 48]"), ("model.heads", 65, "in [1, 64]"),
    ("model.max_positions", 1025, "in [2, 1024]")])
def test_a_size_beyond_its_upper_bound_is_one_line(key, too_big, said):
    overrides = owner(key) + [f"{key}={too_big}"]
    with pytest.raises(InputError) as info:
        load_config(overrides=overrides)
    assert str(info.value) == f"config key {key} must be {said}, got {too_big}"


@pytest.mark.parametrize("key", NUMERIC)
def test_a_number_outside_its_range_is_one_line_naming_the_key_and_the_range(key):
    f, kind = fields_of(key)
    bounds = f.metadata["range"]
    for value in outside(bounds, kind):
        with pytest.raises(InputError) as info:
            load_config(overrides=owner(key) + [f"{key}={value}"])
        assert str(info.value) == f"config key {key} must be {describe_range(bounds)}, got {kind(value)!r}"


def test_range_checks_come_before_tensorflow_starts():
    """Out-of-range values are refused by config loading, in a process that never imports TensorFlow."""
    import subprocess

    code = ("import sys; from captioning.config import load_config; from captioning.errors import InputError\n"
            "try: load_config(None, ['train.warmup_steps=-5'])\n"
            "except InputError as e: print(e)\n"
            "assert 'tensorflow' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip() == \
        "config key train.warmup_steps must be in [0, 1000000000], got -5"


def test_all_keys_names_every_field():
    keys = all_keys()
    def count(values):  # a nested section's keys count one by one
        return sum(count(v) if isinstance(v, dict) else 1 for v in values.values())

    shared = sum(count(v) for k, v in to_dict(load_config()).items() if k != "model") + len(keys_of(ModelConfig))
    assert len(keys) == len(set(keys)) == shared + len(set(OWNER) | set(ENCODER_OWNER))
    assert {"data.cache", "model.encoder", "train.steps", "distribute.tpu", "model.lstm_units",
            "model.attention_size", "train.scheduled_sampling.max"} <= set(keys)


def test_scientific_notation_float_in_yaml(tmp_path):
    # PyYAML (YAML 1.1) reads 5e-4 as a string: a float field must still take it.
    assert load_config(write(tmp_path / "c.yaml", "train:\n  learning_rate: 5e-4\n")).train.learning_rate == 5e-4


def test_empty_section_keeps_defaults(tmp_path):
    assert load_config(write(tmp_path / "c.yaml", "train:\nmodel:\n  lstm_units: 8\n")).train == TrainConfig()


def test_another_components_key_given_by_the_user_is_refused_naming_who_reads_it(tmp_path):
    """Issue 48 item 13: with --set, or in the config file itself, a key the chosen decoder and encoder do not
    read is one line naming the key, the components that read it and the chosen one (the registries asked);
    from a base: it is left out quietly."""
    for overrides, said in (
            (["model.encoder=vit", f"model.encoder_preset={tmp_path}"],
             "model.encoder_preset is read by the keras_hub encoder, not vit: leave it out (given with --set), or "
             "choose model.encoder: keras_hub"),
            (["model.encoder=small_cnn", "model.vit_patch_size=4"],
             "model.vit_patch_size is read by the vit encoder, not small_cnn: leave it out (given with --set), or "
             "choose model.encoder: vit"),
            (["model.attention_size=64", "model.lstm_units=8"],  # show_and_tell: no attention
             "model.attention_size is read by the attention and updown decoders, not show_and_tell: leave it out "
             "(given with --set), or choose model.decoder: attention")):
        assert load_error(None, None, overrides) == said
    assert load_error(tmp_path, "model:\n  decoder: transformer\n  lstm_units: 8\n") == (
        "model.lstm_units is read by the show_and_tell, attention and updown decoders, not transformer: leave it out "
        "(set in the config file), or choose model.decoder: show_and_tell")
    # a base's keys stay quiet: the base serves other experiments
    write(tmp_path / "base.yaml", "model:\n  decoder: attention\n  attention_size: 64\n  encoder: vit\n"
                                  "  vit_patch_size: 4\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\nmodel:\n  decoder: show_and_tell\n"
                                           "  encoder: small_cnn\n")
    assert load_config(child).model.components == {"embedding_size": 512, "lstm_units": 512, "init_scale": 0.08}
    assert load_config(overrides=["model.decoder=attention", "model.attention_size=64"]).model.components[
        "attention_size"] == 64


def test_a_files_key_whose_component_set_switched_is_left_out_with_a_warning(tmp_path, caplog):
    """--config shapes.yaml --set model.decoder=transformer: the file's LSTM sizes were right for the file's own
    decoder; one warning each, not an error. A program's defaults (load_config's) count as a base's."""
    path = write(tmp_path / "c.yaml", "model:\n  lstm_units: 8\n")
    c = load_config(path, ["model.decoder=transformer"])
    assert "lstm_units" not in c.model.components
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "model.lstm_units in the config file is read by the show_and_tell, attention and updown decoders, not "
        "transformer, which --set chose: it is left out"]
    quiet = model_lib.resolve(load_core(None, ["model.decoder=transformer"], defaults=["model.lstm_units=8"]))
    assert "lstm_units" not in quiet.model.components and quiet.given("model.lstm_units") == "base"


def test_train_refuses_another_components_key_in_one_line_before_anything_is_written(tmp_path):
    """The issue's command: a random ViT trained while the user believes a preset was loaded; now exit 2."""
    from tests.helpers import run_cli

    folder = tmp_path / "m"
    done = run_cli("train", "--config", "experiments/shapes.yaml", "--set", "model.encoder=vit", "--set",
                   f"model.encoder_preset={tmp_path}", "--model-dir", folder)
    assert (done.returncode, [line for line in done.stderr.splitlines() if "error" in line]) == (2, [
        "captioning train: error: model.encoder_preset is read by the keras_hub encoder, not vit: leave it out "
        "(given with --set), or choose model.encoder: keras_hub"]), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not folder.exists()
    message = load_error(None, None, ["model.atention_size=64"])
    assert message.startswith("unknown config key 'model.atention_size'; did you mean model.attention_size")
    assert load_error(None, None, ["model.decoder=atention"]) == \
        f"config key model.decoder must be one of {', '.join(model_lib.DECODERS)}, got 'atention' (did you mean attention?)"


def test_set_strips_text_values_and_unknown_sections_are_named():
    assert load_config(None, ["data.cache= memory "]).data.cache == "memory"
    with pytest.raises(InputError, match="sections are data, model, train, distribute"):
        load_config(None, ["nosection=3"])
    with pytest.raises(InputError, match="did you mean train"):
        load_config(None, ["trian.steps=3"])


def test_from_dict_rejects_non_mapping_section():
    with pytest.raises(InputError):
        from_dict({"train": 5})


# --- properties: any key, any value, any YAML gives a valid Config or one clear InputError ----------------

def assert_valid(config):
    """Every key holds a value of its declared type, inside its choices and range, that TensorFlow can
    take."""
    assert isinstance(config, Config)
    decoder = model_lib.DECODERS[config.model.decoder].settings_class
    encoder = model_lib.ENCODERS[config.model.encoder].settings_class
    assert set(config.model.components) == {f.name for f in dataclasses.fields(decoder) + dataclasses.fields(encoder)}
    for key in core_keys() + OBJECTIVE_KEYS + [f"model.{name}" for name in config.model.components]:
        name = key.rsplit(".", 1)[1]
        component = next((c for c in (decoder, encoder) if name in {x.name for x in dataclasses.fields(c)}), None)
        f, kind = fields_of(key) if component is None else (
            next(x for x in dataclasses.fields(component) if x.name == name), typing.get_type_hints(component)[name])
        value = value_of(config, key)
        if "range" in f.metadata:
            low, low_open, high, high_open = f.metadata["range"]
            assert (value > low if low_open else value >= low) and (
                high is None or (value < high if high_open else value <= high)), (key, value)
        if typing.get_args(kind) == (str,):  # a list of words
            assert type(value) is list and all(type(v) is str and v and v.split() == [v] for v in value), key
        elif typing.get_origin(kind) is list:
            assert type(value) is list and all(type(v) is int and -2**63 <= v < 2**63 for v in value), key
        else:
            assert type(value) is kind, (key, value)
        if kind is float:
            assert math.isfinite(value), key
        if kind is int:
            assert -2**63 <= value < 2**63, key
        assert value in f.metadata.get("choices", (value,)), key


def config_or_error(path=None, overrides=(), round_trip=True):
    """load_config's result, checked, or its InputError's message, checked: nothing else may escape."""
    try:
        config = load_config(path, overrides)
    except InputError as e:
        message = str(e)
        assert message and message.isprintable() and len(message) < 1000, repr(message)  # one short line
        return message
    assert_valid(config)
    if not round_trip:
        return config
    with tempfile.TemporaryDirectory() as tmp:  # and what train writes as config.yaml loads back the same
        saved = os.path.join(tmp, "config.yaml")
        save_config(config, saved)
        assert load_config(saved) == config
    return config


CHOICES = sorted({c for key in all_keys() for c in fields_of(key)[0].metadata.get("choices", ())})
VALUE_TEXT = st.one_of(
    st.text(alphabet=st.characters(codec=None, exclude_categories=())),  # anything, lone surrogates too
    st.integers().map(str),
    st.integers(-2**64, 2**64).map(str),
    st.floats().map(repr),  # nan, inf, -0.0, 1e-300 ...
    st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "1" * 400, "9" * 5000, "1_000", "0x10", "\u0663",
                     "[1, 2]", "[[1]]", "[]", "8,12,", " 8 , 12 ", "[1, 99999999999999999999]", "yes", "OFF",
                     "\x00", "a\nb", "none", ""] + CHOICES),
    st.lists(st.integers(-5, 2**63), max_size=4).map(lambda v: ",".join(map(str, v))),
).flatmap(lambda v: st.sampled_from([v, f" {v} ", f"[{v}]"]))
KEY_TEXT = st.one_of(st.sampled_from(all_keys()), st.sampled_from(all_keys()).map(lambda k: k + "s"),
                     st.sampled_from(all_keys()).map(lambda k: k.upper()), st.text(max_size=30))


@PROPERTY
@given(KEY_TEXT, VALUE_TEXT)
@example("train.learning_rate", "1e999")  # was accepted as inf
@example("train.learning_rate", "nan")  # was accepted, and a saved config no longer equalled itself
@example("train.steps", "9" * 30)  # was accepted: an int TensorFlow cannot hold
@example("data.bucket_boundaries", "[1, 99999999999999999999]")
@example("data.dir", "\udcff")  # a non-UTF-8 byte of argv (surrogateescape) still saves and loads
def test_any_override_gives_a_valid_config_or_one_input_error(key, value):
    config_or_error(overrides=[f"{key}={value}"])


@pytest.mark.parametrize("value", ["1e999", "-1e999", "inf", "-Infinity", "nan", "NaN", "1" * 400])
def test_non_finite_float_override_is_refused(value):
    with pytest.raises(InputError, match=r"^config key train.learning_rate must be a finite number, got '"):
        load_config(overrides=[f"train.learning_rate={value}"])


@pytest.mark.parametrize("text, expected", [
    ("train:\n  learning_rate: .inf\n", "train.learning_rate must be a finite number, got inf"),
    ("train:\n  learning_rate: .nan\n", "train.learning_rate must be a finite number, got nan"),
    ("train:\n  learning_rate: 1" + "0" * 400 + "\n", "train.learning_rate must be a number"),  # was OverflowError
    ("train:\n  steps: 9223372036854775808\n", "train.steps must be a 64-bit integer, got 9223372036854775808"),
    ("data:\n  bucket_boundaries: [1, 99999999999999999999]\n", "data.bucket_boundaries must hold 64-bit integers"),
    ("train:\n  steps: 1\n" + "x: " + "[" * sys.getrecursionlimit() + "]" * sys.getrecursionlimit() + "\n",
     "is nested too deeply"),  # was RecursionError
    ("base: .\n", "Is a directory"),  # was IsADirectoryError
    ('base: "nul\\0byte.yaml"\n', "embedded null byte"),  # was ValueError
    ('base: "two\\nlines.yaml"\n', "two\\nlines.yaml' does not exist"),  # the path shown on one line
    ('train: {steps: "\\x01"}\n\x07', "is not valid YAML: unacceptable character #x0007"),  # was two lines
])
def test_unusable_yaml_values_and_files_are_one_line_errors(tmp_path, text, expected):
    message = load_error(tmp_path, text)
    assert expected in message and message.isprintable()


def test_config_that_is_not_utf8_is_an_input_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("data:\n  dir: /donn\u00e9es\n".encode("latin-1"))  # was UnicodeDecodeError
    with pytest.raises(InputError, match="is not UTF-8 text"):
        load_config(str(path))


def typed_value(key):
    """A valid value for ``key`` and its spellings for --set: (value, text)."""
    f, kind = fields_of(key)
    if "choices" in f.metadata:
        return st.sampled_from(f.metadata["choices"]).map(lambda c: (c, c))
    if kind is bool:
        return st.sampled_from(["true", "Yes", "ON", "1", "false", "no", "Off", "0"]).map(
            lambda t: (t.lower() in ("true", "yes", "on", "1"), t))
    low, low_open, high, high_open = f.metadata.get("range", (None, False, None, False))
    if kind is int:
        low = -2**63 if low is None else int(low) + int(low_open)
        high = 2**63 - 1 if high is None else int(high) - int(high_open)
        return st.integers(low, high).map(lambda n: (n, str(n)))
    if kind is float:
        return st.floats(min_value=low, max_value=high, exclude_min=low_open and low is not None,
                         exclude_max=high_open and high is not None, allow_nan=False,
                         allow_infinity=False).map(lambda x: (x, repr(x)))
    if kind is str:
        return st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cc", "Zs", "Zl", "Zp"))).map(
            lambda t: (t, t))
    if typing.get_args(kind) == (str,):  # words: no space, comma, bracket or quote inside one
        word = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cc", "Z"),
                                              exclude_characters=",[]'\""), min_size=1)
        return st.lists(word, max_size=4).flatmap(lambda v: st.sampled_from(
            [(v, ",".join(v)), (v, f"[{', '.join(v)}]")]))
    return st.lists(st.integers(-2**63, 2**63 - 1), max_size=5).flatmap(lambda v: st.sampled_from(
        [(v, ",".join(map(str, v))), (v, f"[{', '.join(map(str, v))}]")]))


@PROPERTY
@given(st.sampled_from(all_keys()).flatmap(lambda k: st.tuples(st.just(k), typed_value(k))),
       st.sampled_from(["", " ", "\t"]))
def test_every_valid_spelling_is_accepted_with_its_exact_value(key_value_text, pad):
    key, (value, text) = key_value_text
    config = config_or_error(overrides=owner(key) + [f"{key}={pad}{text}{pad}"], round_trip=False)
    if isinstance(config, str):  # a rule between this key and another of its section (image_size > resize_size)
        assert key in config, config
        return
    got = value_of(config, key)
    assert got == value and type(got) is type(value)


def yaml_values(keys):
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                        st.text(alphabet=st.characters(codec="utf-8")), st.sampled_from(CHOICES), st.dates())
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(keys, inner, max_size=4)), max_leaves=12)


NAMES = st.one_of(st.sampled_from(sorted({k.split(".")[1] for k in all_keys()})), st.text(max_size=10),
                  st.integers(), st.none())
SECTION_NAMES = st.one_of(st.sampled_from(["data", "model", "train", "distribute", "decode", "scst", "base"]), NAMES)
YAML_DOCUMENTS = st.one_of(
    yaml_values(NAMES),  # anything at all
    st.dictionaries(SECTION_NAMES, st.one_of(yaml_values(NAMES), st.dictionaries(NAMES, yaml_values(NAMES),
                                                                                  max_size=6)), max_size=5),
    st.fixed_dictionaries({}, optional={s: st.fixed_dictionaries({}, optional={  # mostly valid: real keys
        k.split(".")[1]: yaml_values(NAMES) for k in all_keys() if k.startswith(s + ".")}) for s in
        ["data", "model", "train", "distribute", "decode", "scst"]}),
)


@settings(PROPERTY, max_examples=100)  # YAML is slow to write and read in pure Python
@given(YAML_DOCUMENTS)
@example({"train": {"learning_rate": float("inf")}})
@example({"train": {"learning_rate": 10 ** 400}})  # float() of it raised OverflowError
@example({"base": {None: None, "": [1]}})  # a mapping as base: a very long file name (was OSError)
@example({"base": "."})
@example({"data": {"dir": datetime.date(2020, 1, 1)}, "train": {"steps": None}})
def test_any_yaml_content_gives_a_valid_config_or_one_input_error(document):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(document, f, allow_unicode=True)
        config_or_error(path)


@pytest.mark.parametrize("overrides, fragment", [
    (["data.group_captions=-1"], "config key data.group_captions must be in [0, 100], got -1"),
    (["data.group_captions=3"], "data.group_captions (3) applies to data.captions_per_image: grouped, not all"),
    (["data.group_captions=3", "data.captions_per_image=sample"], "grouped, not sample"),
])
def test_cross_key_checks_name_the_keys(overrides, fragment):
    from captioning.config import validate

    with pytest.raises(InputError) as info:
        validate(load_config(None, ["data.dir=d"] + overrides))
    assert fragment in str(info.value)
    validate(load_config(None, ["data.dir=d", "data.captions_per_image=grouped", "data.group_captions=5"]))


# --- format versions: folders written by earlier code keep loading --------------------------------------

V1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "model_folders_v1")


@pytest.mark.parametrize("name, decoder, options", [
    ("show_and_tell", "show_and_tell", {"embedding_size": 32, "lstm_units": 32, "init_scale": 0.08}),
    ("attention", "attention", {"embedding_size": 32, "lstm_units": 32, "init_scale": 0.08, "attention_size": 16,
                                "attention_l1": 1.0}),
])
def test_a_format_1_config_written_by_earlier_code_loads(name, decoder, options, tmp_path):
    """tests/data/model_folders_v1 holds config.yaml files that the code of commit 881ad0a wrote (format 1:
    no format_version, every decoder's keys in model:). They load through the migration, and saved again
    they are of the current format and load back the same."""
    from captioning.model.folder import ModelDir

    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(os.path.join(V1, f"{name}.config.yaml"), folder / "config.yaml")
    cfg = ModelDir(str(folder)).read_config()  # scst: as written, typed by the training stage
    assert (cfg.model.decoder, cfg.model.encoder, cfg.model.components) == (decoder, "small_cnn", options)
    cfg = objectives.resolve(cfg, complete=True)
    assert (cfg.train.steps, cfg.data.image_size, cfg.scst.samples) == ((30, 32, 5) if decoder == "show_and_tell"
                                                                       else (10, 32, 5))
    save_config(cfg, str(folder / "config.yaml"))
    assert f"format_version: {CONFIG_FORMAT}" in (folder / "config.yaml").read_text()
    assert (cfg.data.features, cfg.model.region_feature_size, cfg.model.box_geometry) == ("images", 0, False)
    assert objectives.resolve(ModelDir(str(folder)).read_config(), complete=True) == cfg


def test_a_format_1_file_from_before_keys_were_added_gets_their_defaults_of_then(tmp_path):
    """Format-1 files written before a key existed lack it; the migration gives each the value it had when it
    appeared (never today's default, which may change); a key missing from a format-2 file is damage."""
    data = yaml.safe_load(open(os.path.join(V1, "show_and_tell.config.yaml")))
    del data["decode"], data["scst"], data["train"]["objective"], data["model"]["decoder"]
    del data["data"]["service"], data["distribute"]["peer_timeout_s"]
    path = write(tmp_path / "config.yaml", yaml.safe_dump(data))
    cfg = load_config(path, complete=True)
    assert (cfg.model.decoder, cfg.train.objective, cfg.decode.beam_size, cfg.scst.max_length, cfg.data.service,
            cfg.distribute.peer_timeout_s) == ("show_and_tell", "xe", 3, 16, "", 30)
    del data["train"]["steps"]  # a key format 1 always had: damage
    with pytest.raises(InputError, match=r"lacks 1 of its keys \(train.steps\): it is cut short or damaged"):
        load_config(write(tmp_path / "config.yaml", yaml.safe_dump(data)), complete=True)
    saved = tmp_path / "v2.yaml"
    save_config(cfg, str(saved))
    text = saved.read_text().replace("  lstm_units: 32\n", "")
    with pytest.raises(InputError, match=r"lacks 1 of its keys \(model.lstm_units\)"):
        load_config(write(saved, text), complete=True)
    newer = CONFIG_FORMAT + 1
    with pytest.raises(InputError, match=f"format_version {newer}; this code reads formats 1 to {CONFIG_FORMAT}"):
        load_config(write(saved, text.replace(f"format_version: {CONFIG_FORMAT}", f"format_version: {newer}")),
                    complete=True)


def test_a_format_2_config_reads_images(tmp_path):
    """Format 3 brought region features: a format-2 config.yaml (every key of then) loads with the image
    input it had; a format-3 file lacking one of those keys is damage."""
    cfg = load_config(os.path.join(V1, "show_and_tell.config.yaml"), complete=True)
    data = to_dict(cfg)
    for section, key in (("data", "features"), ("data", "features_store"), ("model", "region_feature_size"),
                         ("model", "box_geometry"), ("model", "regions_from_encoder")):
        del data[section][key]
    path = write(tmp_path / "v2.yaml", yaml.safe_dump({"format_version": 2, **data}))
    assert load_config(path, complete=True) == cfg
    path = write(tmp_path / "v3.yaml", yaml.safe_dump({"format_version": 3, **data}))
    with pytest.raises(InputError, match=r"lacks 5 of its keys"):
        load_config(path, complete=True)


def test_there_is_one_migration_for_each_older_format_in_order():
    """config_migrations only grows: each format N < FORMAT_VERSION has one migration to N + 1, registered in the
    order of the file (a new one is appended), and a second one for the same format is refused at import."""
    import inspect

    from captioning.config import migrations as config_migrations

    assert list(config_migrations.MIGRATIONS) == list(range(1, CONFIG_FORMAT))
    lines = [inspect.getsourcelines(f)[1] for f in config_migrations.MIGRATIONS.values()]
    assert lines == sorted(lines)
    with pytest.raises(AssertionError):
        config_migrations.migration(1)(lambda data: data)
    assert config_migrations.MIGRATIONS[1].__name__ == "_from_format_1"


@pytest.mark.parametrize("version, section, key, value", [
    (3, "train", "steps_per_execution", 1), (4, "scst", "xla_sampling", True), (6, "train", "ema_decay", 0.0),
    (6, "train", "accumulate_steps", 1), (6, "scst", "xe_weight", 0.0),
    (6, "train", "scheduled_sampling", ScheduledSamplingConfig(start=0.0, increase=0.05, increase_every=5000, max=0.0)),
    (8, "train", "fused_updates", False)])
def test_a_key_added_by_a_later_format_gets_the_behaviour_of_its_time(tmp_path, version, section, key, value):
    """Format 4 brought train.steps_per_execution (a format-3 model ran one step a call), format 5
    scst.xla_sampling (the same samples, drawn faster), format 7 the EMA, accumulation, scheduled sampling (a
    nested section: all its keys) and SCST's cross-entropy term, all off, format 9 the fused optimizer updates
    (off: Keras' element-wise update, as before, bit for bit): an older file without the key loads with that
    value; a file of the current format without it is damage."""
    cfg = load_config(os.path.join(V1, "show_and_tell.config.yaml"), complete=True)
    data = to_dict(cfg)
    del data[section][key]
    loaded = load_config(write(tmp_path / "old.yaml", yaml.safe_dump({"format_version": version, **data})),
                         complete=True)
    assert getattr(getattr(loaded, section), key) == value and loaded == cfg
    with pytest.raises(InputError, match=r"lacks (1|4) of its keys"):
        load_config(write(tmp_path / "now.yaml", yaml.safe_dump({"format_version": CONFIG_FORMAT, **data})),
                    complete=True)


@pytest.mark.parametrize("key, too_big, bound", [
    ("beam_size", 100000, "[1, 50]"), ("top_k", 51, "[1, 50]"), ("beam_groups", 51, "[1, 50]"),
    ("max_length", 101, "[1, 100]"), ("block_ngrams", 101, "[0, 100]"), ("sample_top_k", 100001, "[0, 100000]")])
def test_every_decoding_size_has_an_upper_bound_checked_however_it_is_given(key, too_big, bound, tmp_path):
    """A config file or --set, a command's flag (DecodeConfig.override), and the check a command makes before
    its model loads (check_given): one line naming the key and its bound."""
    from captioning.config import DecodeConfig

    assert load_error(tmp_path, f"decode:\n  {key}: {too_big}\n") == \
        f"config key decode.{key} must be in {bound}, got {too_big}"
    with pytest.raises(InputError, match=rf"^config key decode.{key} must be in \{bound[:-1]}\], got {too_big}$"):
        DecodeConfig.check_given([f"decode.{key}={too_big}"])
    with pytest.raises(InputError) as info:
        DecodeConfig().override(**{key: too_big})
    assert str(info.value) == f"`{key}` must be in {bound}, got {too_big}" and info.value.params == (key,)
    with pytest.raises(InputError, match=rf"`{key}` must be in"):
        DecodeConfig.check_given(**{key: too_big})
    DecodeConfig.check_given([f"decode.{key}={1 if key != 'top_k' else 2}"], beam_size=None)  # fine alone


def test_integer_bounds_are_printed_as_integers(tmp_path):
    assert load_error(tmp_path, "decode:\n  seed: -1\n") == "config key decode.seed must be in [0, 2147483647], got -1"
    assert load_error(tmp_path, "train:\n  seed: 2147483648\n") == \
        "config key train.seed must be in [0, 2147483647], got 2147483648"
    assert describe_range((0.0, False, 1.0, True)) == "in [0, 1)" and describe_range((0.5, True, None, False)) == \
        "more than 0.5"


def test_decoding_settings_that_do_nothing_are_named_one_line_each():
    from captioning.config import DecodeConfig

    assert DecodeConfig().ineffective() == [] and DecodeConfig(method="sample", temperature=0.5, top_k=3,
                                                                sample_top_p=0.9, seed=3).ineffective() == []
    assert DecodeConfig(beam_size=6, beam_groups=3, diversity=0.5, length_penalty="gnmt",
                        length_normalization=0.7).ineffective() == []
    lines = DecodeConfig(temperature=0.5, diversity=0.5, length_normalization=0.7, length_penalty="none").ineffective()
    assert lines == [
        "decode.temperature 0.5 does nothing: it applies to decode.method: sample, not beam",
        "decode.diversity 0.5 does nothing: it needs decode.beam_groups above 1 (and decode.method: beam), got 1 "
        "group(s) and beam",
        "decode.length_normalization (--length-normalization) 0.7 does nothing with decode.length_penalty: none "
        "(use avg or gnmt)"]
    assert all("\n" not in line for line in lines)
    assert DecodeConfig(method="greedy", sample_top_k=5).ineffective() == [
        "decode.sample_top_k 5 does nothing: it applies to decode.method: sample, not greedy"]
