"""The model stage: image encoders, decoders behind one interface, and decoding (beam search).

:data:`DECODERS` is the registry of decoders: ``model.decoder`` names one of them. A decoder class
(:class:`~captioning.model.base.CaptionModel`) declares everything the rest of the code asks about it
— its own settings (a dataclass, :attr:`~captioning.model.base.CaptionModel.settings_class`), which of
them change its variables' shapes (``incompatible_keys``), whether it reads the encoder's grid or its
pooled features (``features``) — so nothing outside its module tests its name. A new decoder is a
module here and one entry in :data:`DECODERS`; the contract tests (tests/test_decoders.py) run over
every entry.

The decoder's settings are written in ``model:`` beside the shared keys (``model.lstm_units``). The
config loader keeps them as given; :func:`resolve` types and checks them against the chosen decoder's
dataclass (a key another decoder declares is not this one's business and is left out; a key no decoder
declares is an error).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math

from captioning import config as config_lib
from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model.attention import ShowAttendTell
from captioning.model.base import CaptionModel
from captioning.model.encoders import SMALL_CNN_FILTERS, all_layers, build_encoder
from captioning.model.show_and_tell import ShowAndTell
from captioning.model.transformer import Transformer
from captioning.model.updown import UpDown

log = logging.getLogger("captioning.model")

DECODERS: dict[str, type[CaptionModel]] = {"show_and_tell": ShowAndTell, "attention": ShowAttendTell,
                                           "transformer": Transformer, "updown": UpDown}


def decoder_class(name: str) -> type[CaptionModel]:
    """The registered decoder ``name``; an InputError naming ``model.decoder`` and the choices otherwise."""
    if name not in DECODERS:
        near = difflib.get_close_matches(name, list(DECODERS), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise InputError(f"config key model.decoder must be one of {', '.join(DECODERS)}, got {name!r}{hint}")
    return DECODERS[name]


def _options_of(model_cfg: ModelConfig) -> dict:
    """The decoder's own keys among ``model_cfg.options``: the others declared by another decoder are left
    out; an undeclared one is an InputError naming the nearest keys."""
    mine = {f.name for f in dataclasses.fields(decoder_class(model_cfg.decoder).settings_class)}
    others = {f.name: name for name, cls in DECODERS.items() for f in dataclasses.fields(cls.settings_class)}
    known = [f"model.{k}" for k in sorted(mine | set(others) | set(config_lib.keys_of(ModelConfig)))]
    out = {}
    for key, value in model_cfg.options.items():
        if key in mine:
            out[key] = value
        elif key in others:
            log.debug("model.%s is a setting of other decoders, not of %s: left out", key, model_cfg.decoder)
        else:
            near = difflib.get_close_matches(f"model.{key}", known, n=4, cutoff=0.5)
            raise InputError(f"unknown config key 'model.{key}'" + (f"; did you mean {', '.join(near)}?" if near else
                                                                     f"; the model keys are {', '.join(known)}"))
    return out


def settings_of(model_cfg: ModelConfig, complete: bool = False):
    """The chosen decoder's settings (an instance of its ``settings_class``), typed and checked.
    ``complete``: every one of them must be given (a saved config.yaml)."""
    cls = decoder_class(model_cfg.decoder).settings_class
    return config_lib.section_from(cls, _options_of(model_cfg), "model.", complete=complete,
                                   where=f"the model section (decoder {model_cfg.decoder})")


def resolve(cfg: config_lib.Config, complete: bool = False) -> config_lib.Config:
    """A copy of ``cfg`` whose ``model.options`` are exactly the decoder's settings, typed (every one of
    them, defaults included): what training records and compares."""
    out = copy.copy(cfg)
    out.model = dataclasses.replace(cfg.model, options=dataclasses.asdict(settings_of(cfg.model, complete)))
    object.__setattr__(out, "_given", getattr(cfg, "_given", {}))
    return out


def check_caption_length(model_cfg: ModelConfig, key: str, length: int) -> None:
    """An InputError (one line) when ``length`` words, the value of ``key`` (``decode.max_length``,
    ``scst.max_length``), are more than the decoder of ``model_cfg`` can decode with its settings
    (:meth:`~captioning.model.base.CaptionModel.max_caption_length`)."""
    cls = decoder_class(model_cfg.decoder)
    limit = cls.max_caption_length(settings_of(model_cfg))
    if limit is not None and length > limit:
        why = f" (model.{cls.caption_length_setting})" if cls.caption_length_setting else ""
        raise InputError(f"{key} is {length}, but model.decoder {model_cfg.decoder} decodes captions of at most "
                         f"{limit} words{why}: use at most {limit}")


def all_keys() -> list[str]:
    """Every decoder's own keys, ``model.<name>``, each once."""
    return sorted({f"model.{f.name}" for cls in DECODERS.values() for f in dataclasses.fields(cls.settings_class)})


def small_cnn_grid(image_size: int) -> int:
    """The side of small_cnn's final grid (stride-2 'same' convolutions)."""
    return math.ceil(image_size / 2 ** len(SMALL_CNN_FILTERS))


def architecture_diff(old: config_lib.Config, new: config_lib.Config) -> list[str]:
    """The keys in which the models of two configs differ in their variables' shapes (a checkpoint of
    one does not fit the other): the decoder, the encoder, the decoder's ``incompatible_keys``, and for
    a decoder reading pooled features of small_cnn (which flattens its grid) the image size; the size of the
    region features read and whether their boxes are added."""
    diff = [f"model.{k}" for k in ("decoder", "encoder", "region_feature_size", "box_geometry")
            if getattr(old.model, k) != getattr(new.model, k)]
    if diff:
        return diff
    cls = decoder_class(new.model.decoder)
    a, b = settings_of(old.model), settings_of(new.model)
    diff = [f"model.{k}" for k in cls.incompatible_keys if getattr(a, k) != getattr(b, k)]
    if (cls.features == "pooled" and new.model.encoder == "small_cnn"
            and small_cnn_grid(old.data.image_size) != small_cnn_grid(new.data.image_size)):
        diff.append("data.image_size (small_cnn flattens a grid whose size depends on it)")
    return diff


def build_model(vocab_size: int, cfg: ModelConfig, image_size: int, seed: int = 0) -> CaptionModel:
    """The model of ``cfg.decoder`` (not built: call ``build_all()`` to create its variables)."""
    cls = decoder_class(cfg.decoder)
    model = cls(vocab_size, cfg, image_size, seed=seed, settings=settings_of(cfg))
    if model.reads_regions:  # training reads regions: the encoder (for new images' regions) is not trained
        model.encoder.trainable = False
    return model


__all__ = ["CaptionModel", "DECODERS", "SMALL_CNN_FILTERS", "ShowAndTell", "ShowAttendTell", "Transformer", "all_keys",
           "all_layers",
           "architecture_diff", "build_encoder", "build_model", "check_caption_length", "decoder_class", "resolve",
           "settings_of"]
