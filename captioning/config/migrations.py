"""The format versions of a saved config (a model folder's ``config.yaml``) and the migrations between them.

A saved config records every key and the format it was written in (``format_version``; a file without
one is format 1). Reading an older format applies the migrations of :data:`MIGRATIONS` in order, each a
function written once and never changed, so folders trained by earlier versions of this code keep loading
(tests/data/model_folders_v1 holds such files). This module only grows: a new format appends a function
decorated ``@migration(N)`` at the end and bumps :data:`FORMAT_VERSION`; no migration is edited once
released.

A migration works on the file's mapping of sections (``{"train": {...}, "scst": {...}}``), before any
section is typed, so it needs no section's class: the shared sections' (:mod:`captioning.config.sections`)
and the components' (a decoder's ``model.*`` keys, an objective's ``scst:``) alike.
"""

from __future__ import annotations

import typing

from captioning.errors import InputError, excerpt

FORMAT_VERSION = 13  # of a saved config.yaml: one more than the newest migration's
# format N → N + 1, filled by @migration below, in the order the formats came
MIGRATIONS: dict[int, typing.Callable[[dict], dict]] = {}


def migrate(data: dict, where: str) -> dict:
    """A saved config's mapping in the current format (see the module docstring)."""
    version = data.pop("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise InputError(f"{where} has format_version {excerpt(version)}; this code reads formats 1 to "
                         f"{FORMAT_VERSION}: it was written by a newer version of captioning, or is damaged")
    for step in range(version, FORMAT_VERSION):
        data = MIGRATIONS[step](data)
    return data


def migration(version: int):
    """Registers the function it decorates as the migration from format ``version`` to the next."""
    def register(function):
        assert version not in MIGRATIONS and version < FORMAT_VERSION, version
        MIGRATIONS[version] = function
        return function
    return register


# ---- the migrations, oldest first: append a new one at the end, never edit one once released ----------


def with_defaults(data: dict, added: dict) -> dict:
    """A copy of ``data`` (a config file's sections) with each ``section.key`` of ``added`` at its value where the
    file does not give it (a section that is not a mapping is left for the loader to refuse).

    >>> with_defaults({"train": {"steps": 5}}, {"train.steps": 1, "scst.samples": 5})
    {'train': {'steps': 5}, 'scst': {'samples': 5}}
    """
    out = {section: dict(values or {}) if isinstance(values, dict) else values for section, values in data.items()}
    for key, default in added.items():
        section, name = key.split(".")
        if isinstance(out.setdefault(section, {}), dict):
            out[section].setdefault(name, default)
    return out


@migration(1)
def _from_format_1(data: dict) -> dict:
    """Format 1 (config.yaml without ``format_version``, written until November 2026): keys were added over
    time without a version, so an older file may lack the ones below; they get the default they had when
    they appeared. Every decoder's settings sat in ``model:`` whatever the decoder (``attention_size``
    and ``attention_l1`` in a Show-and-Tell folder too); format 2 keeps only the chosen decoder's."""
    added_later = {"distribute.peer_timeout_s": 30, "distribute.startup_timeout_s": 600,
                   "model.decoder": "show_and_tell", "decode.beam_size": 3, "decode.max_length": 20,
                   "decode.length_normalization": 0.0, "decode.top_k": 1, "train.jit_compile": False,
                   "train.split_padding": False, "data.group_captions": 0, "train.momentum": 0.0,
                   "model.attention_size": 512, "model.attention_l1": 1.0, "train.objective": "xe",
                   "scst.samples": 5, "scst.baseline": "mean", "scst.max_length": 16, "scst.temperature": 1.0,
                   "scst.end_in_reward": True, "data.service": "", "data.service_mode": "parallel_epochs",
                   "data.service_timeout_s": 60, "data.service_compression": "none",
                   # keys that came with format 2, at the values that reproduce format 1's behaviour
                   "train.label_smoothing": 0.0, "train.weight_decay": 0.01}
    out = with_defaults(data, added_later)
    model = out.get("model")
    if isinstance(model, dict) and model.get("decoder") != "attention":
        model.pop("attention_size", None)
        model.pop("attention_l1", None)
    return out


@migration(2)
def _from_format_2(data: dict) -> dict:
    """Format 3 brought region features (data.features, data.features_store, model.region_feature_size,
    model.box_geometry, model.regions_from_encoder) and the decoding options (decode.method, ...); a format-2
    model read images and decoded by plain beam search."""
    added = {"data.features": "images", "data.features_store": "regions", "model.region_feature_size": 0,
             "model.box_geometry": False, "model.regions_from_encoder": False, "decode.method": "beam",
             "decode.length_penalty": "avg", "decode.beam_groups": 1, "decode.diversity": 0.0,
             "decode.block_ngrams": 0, "decode.bad_endings": [],
             "decode.temperature": 1.0, "decode.sample_top_k": 0, "decode.sample_top_p": 1.0, "decode.seed": 0}
    return with_defaults(data, added)


@migration(3)
def _from_format_3(data: dict) -> dict:
    """Format 4 brought train.steps_per_execution; a format-3 model ran one step per call."""
    return with_defaults(data, {"train.steps_per_execution": 1})


@migration(4)
def _from_format_4(data: dict) -> dict:
    """Format 5 brought scst.xla_sampling; it draws the same samples as a format-4 model did, faster."""
    return with_defaults(data, {"scst.xla_sampling": True})


@migration(5)
def _from_format_5(data: dict) -> dict:
    """Format 6 brought train.encoder_lr_scale; a format-5 model trained its encoder at the decoder's rate (1)."""
    return with_defaults(data, {"train.encoder_lr_scale": 1.0})


@migration(6)
def _from_format_6(data: dict) -> dict:
    """Format 7 brought train.ema_decay, train.accumulate_steps, train.scheduled_sampling and scst.xe_weight; a
    format-6 model kept no average, took a step per batch, was always teacher-forced and mixed no cross-entropy
    into SCST."""
    return with_defaults(data, {"train.ema_decay": 0.0, "train.accumulate_steps": 1,
                                "train.scheduled_sampling": {"start": 0.0, "increase": 0.05, "increase_every": 5000,
                                                             "max": 0.0},
                                "scst.xe_weight": 0.0})


@migration(7)
def _from_format_7(data: dict) -> dict:
    """Format 8 brought data.region_pad_multiple; a format-7 model padded each batch's regions to its largest
    count (1)."""
    return with_defaults(data, {"data.region_pad_multiple": 1})


@migration(8)
def _from_format_8(data: dict) -> dict:
    """Format 9 brought train.fused_updates; a format-8 model was updated by Keras' element-wise update, which
    false keeps bit for bit when it trains on (true: the fused kernels, Adam's last bits rounded differently)."""
    return with_defaults(data, {"train.fused_updates": False})


@migration(9)
def _from_format_9(data: dict) -> dict:
    """Format 10 brought data.tokenizer; a format-9 model read the prepared dataset's word vocabulary (words)."""
    return with_defaults(data, {"data.tokenizer": "words"})


@migration(10)
def _from_format_10(data: dict) -> dict:
    """Format 11 brought train.lm_lr_scale; a format-10 model had no language model to scale (1)."""
    return with_defaults(data, {"train.lm_lr_scale": 1.0})


@migration(11)
def _from_format_11(data: dict) -> dict:
    """Format 12 brought decode.jit_compile; a format-11 model decoded without XLA (false)."""
    return with_defaults(data, {"decode.jit_compile": False})


@migration(12)
def _from_format_12(data: dict) -> dict:
    """Format 13 brought SCST's CLIP reward; a format-12 model's SCST rewarded CIDEr-D."""
    return with_defaults(data, {"scst.reward": "cider", "scst.clip_preset": "", "scst.clip_weight": 1.0})
