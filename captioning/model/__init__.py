"""The model stage: image encoders and decoders behind one interface each, and decoding (beam search).

:data:`DECODERS` is the registry of decoders: ``model.decoder`` names one of them, as ``model.encoder`` names
one of :data:`~captioning.model.encoders.ENCODERS`. :func:`build_model` builds the encoder once and hands it
to the decoder. A decoder class
(:class:`~captioning.model.base.CaptionModel`) declares everything the rest of the code asks about it
— its own settings (a dataclass, :attr:`~captioning.model.base.CaptionModel.settings_class`), which of
them change its variables' shapes (``incompatible_keys``), whether it reads the encoder's grid or its
pooled features (``features``) — so nothing outside its module tests its name. A new decoder is a
module here and one entry in :data:`DECODERS`; the contract tests (tests/test_decoders.py) run over
every entry.

The decoder's and the encoder's settings are written in ``model:`` beside the shared keys
(``model.lstm_units``, ``model.vit_layers``). The config loader keeps them as given; :func:`resolve` types and
checks them against the chosen decoder's and encoder's dataclasses (a key another component declares is not
this one's business and is left out; a key no component declares is an error). A key the user gave — with
``--set``, or in the config file itself — that neither the chosen decoder nor the chosen encoder reads is an error
naming the components that read it (:func:`check_read`): a user who sets ``model.encoder_preset`` believes a
preset is loaded. A key of a config's ``base:`` may stay quiet (a base serves several experiments).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os

from captioning import config as config_lib
from captioning.config import settings as settings_lib
from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model.attention import ShowAttendTell
from captioning.model.base import CaptionModel
from captioning.model.encoders import ENCODERS, all_layers, build_encoder, encoder_class
from captioning.model.prefix_lm import PrefixLM
from captioning.model.show_and_tell import ShowAndTell
from captioning.model.transformer import Transformer
from captioning.model.updown import UpDown
from captioning.model.vlm import VisionLanguageModel

log = logging.getLogger("captioning.model")

DECODERS: dict[str, type[CaptionModel]] = {"show_and_tell": ShowAndTell, "attention": ShowAttendTell,
                                           "transformer": Transformer, "updown": UpDown, "prefix_lm": PrefixLM,
                                           "vlm": VisionLanguageModel}


def decoder_class(name: str) -> type[CaptionModel]:
    """The registered decoder ``name``; an InputError naming ``model.decoder`` and the choices otherwise."""
    return settings_lib.registered(DECODERS, "model.decoder", name)


def _options_of(model_cfg: ModelConfig, cls) -> dict:
    """``cls``'s own keys among ``model_cfg.options`` (``cls``: the chosen decoder's or encoder's class): the keys
    another decoder or encoder declares are left out; an undeclared one is an InputError naming the nearest."""
    mine = {f.name for f in dataclasses.fields(cls.settings_class)}
    components = [*DECODERS.values(), *ENCODERS.values()]
    others = {f.name for c in components for f in dataclasses.fields(c.settings_class)}
    known = [f"model.{k}" for k in sorted(mine | others | set(settings_lib.keys_of(ModelConfig)))]
    out = {}
    for key, value in model_cfg.options.items():
        if key in mine:
            out[key] = value
        elif key in others:
            log.debug("model.%s is a setting of other components, not of %s", key, cls.__name__)
        else:
            near = difflib.get_close_matches(f"model.{key}", known, n=4, cutoff=0.5)
            raise InputError(f"unknown config key 'model.{key}'" + (f"; did you mean {', '.join(near)}?" if near else
                                                                     f"; the model keys are {', '.join(known)}"))
    return out


def _declared(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls.settings_class)}


def _names(names: list[str], kind: str) -> str:
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"the {listed} {kind}{'s' if len(names) > 1 else ''}"


def check_read(cfg: config_lib.Config) -> None:
    """The rule for a component's key that the chosen components do not read (``model.encoder_preset`` under
    ``model.encoder: vit``, ``model.attention_size`` under ``show_and_tell``): the registries are asked which
    decoders and encoders declare it. Given with ``--set``, or in the config file itself, it is an InputError
    naming the key, the components that read it and the chosen one; from a ``base:`` (or a program's
    defaults) it is left out quietly. One exception, a warning instead: a key in the config file whose choice
    (``model.decoder`` for a decoder's key) was changed with ``--set`` — the file's key was right for the file's
    own choice (``--config experiments/shapes.yaml --set model.decoder=transformer``). A key no component
    declares is left to :func:`typed_model` (unknown, with the nearest ones)."""
    model = cfg.model
    decoder_class(model.decoder), encoder_class(model.encoder)  # an unknown choice is its own error, first
    registries = {"decoder": DECODERS, "encoder": ENCODERS}  # model.decoder, model.encoder choose from them
    for key in model.options:
        how = cfg.given(f"model.{key}")
        readers = {kind: [name for name, cls in registry.items() if key in _declared(cls)]
                   for kind, registry in registries.items()}
        readers = {kind: names for kind, names in readers.items() if names}
        if how not in ("set", "file") or not readers or any(getattr(model, kind) in names
                                                            for kind, names in readers.items()):
            continue
        who = " and ".join(_names(names, kind) for kind, names in readers.items())
        chosen = " or ".join(getattr(model, kind) for kind in readers)
        if how == "file" and any(cfg.given(f"model.{kind}") == "set" for kind in readers):
            log.warning("model.%s in the config file is read by %s, not %s, which --set chose: it is left out",
                        key, who, chosen)
            continue
        kind, names = next(iter(readers.items()))
        where = "given with --set" if how == "set" else "set in the config file"
        raise InputError(f"model.{key} is read by {who}, not {chosen}: leave it out ({where}), or choose "
                         f"model.{kind}: {names[0]}")


def _typed(cls, model_cfg: ModelConfig, complete: bool, what: str):
    """``cls``'s settings (the chosen decoder's or encoder's ``settings_class``) from ``model_cfg.options``, typed
    and checked; ``complete``: every one of them must be given (a saved config.yaml)."""
    return settings_lib.section_from(cls.settings_class, _options_of(model_cfg, cls), "model.", complete=complete,
                                     where=f"the model section ({what})")


def typed_model(model_cfg: ModelConfig, complete: bool = False) -> ModelConfig:
    """A copy of ``model_cfg`` with the chosen decoder's and encoder's settings typed and checked
    (:attr:`~captioning.config.ModelConfig.decoder_settings`, ``encoder_settings``: every one of them, defaults
    included; the paths the encoder's and decoder's ``path_keys`` name made absolute) and ``options`` emptied: the
    one place a component's key is typed. ``model_cfg`` typed already is returned as it is. ``complete``: every key
    must be given (a saved config.yaml)."""
    if model_cfg.typed:
        return model_cfg
    decoder = _typed(decoder_class(model_cfg.decoder), model_cfg, complete, f"decoder {model_cfg.decoder}")
    encoder = _typed(encoder_class(model_cfg.encoder), model_cfg, complete, f"encoder {model_cfg.encoder}")
    for cls, settings in ((encoder_class(model_cfg.encoder), encoder), (decoder_class(model_cfg.decoder), decoder)):
        for key in getattr(cls, "path_keys", ()):  # a folder or file named relative to here, made absolute
            value = getattr(settings, key)
            if value and os.path.exists(value):
                setattr(settings, key, os.path.abspath(value))
    return dataclasses.replace(model_cfg, options={}, decoder_settings=decoder, encoder_settings=encoder)


def resolve(cfg: config_lib.Config, complete: bool = False) -> config_lib.Config:
    """A copy of ``cfg`` whose model section is typed (:func:`typed_model`): what training records and
    compares. A key the user gave that neither the decoder nor the encoder reads is refused first
    (:func:`check_read`; not in a saved config.yaml, ``complete``, which holds theirs only)."""
    if cfg.model.typed:
        return cfg
    if not complete:
        check_read(cfg)
    return dataclasses.replace(cfg, model=typed_model(cfg.model, complete))


def check_caption_length(model_cfg: ModelConfig, key: str, length: int) -> None:
    """An InputError (one line) when ``length`` words, the value of ``key`` (``decode.max_length``,
    ``scst.max_length``), are more than the decoder of ``model_cfg`` can decode with its settings
    (:meth:`~captioning.model.base.CaptionModel.max_caption_length`)."""
    cls = decoder_class(model_cfg.decoder)
    limit = cls.max_caption_length(typed_model(model_cfg).decoder_settings)
    if limit is not None and length > limit:
        why = f" (model.{cls.caption_length_setting})" if cls.caption_length_setting else ""
        raise InputError(f"{key} is {length}, but model.decoder {model_cfg.decoder} decodes captions of at most "
                         f"{limit} words{why}: use at most {limit}")


def all_keys() -> list[str]:
    """Every decoder's and encoder's own keys, ``model.<name>``, each once."""
    return sorted({f"model.{f.name}" for cls in [*DECODERS.values(), *ENCODERS.values()]
                   for f in dataclasses.fields(cls.settings_class)})


def _images_unless(source, model_cfg: ModelConfig):
    """``source``, or when it is None the images' data source of a model of ``model_cfg``, checked (a model
    section with region keys is refused in one line: give its source) — :mod:`captioning.model.data_sources`
    comes after this module, whose functions take a source as an argument."""
    if source is not None:
        return source
    from captioning.model.data_sources.images import Images

    images = Images(config_lib.Config(model=model_cfg))
    images.check()
    return images


def architecture_diff(old: config_lib.Config, new: config_lib.Config, source=None) -> list[str]:
    """The keys in which the models of two configs differ in their variables' shapes (a checkpoint of
    one does not fit the other): the decoder, the encoder, their ``incompatible_keys``, the image size where
    the encoder's shapes follow it (:meth:`~captioning.model.encoders.base.ImageEncoder.shapes_follow_image_size`);
    the size of the region features read and whether their boxes are added. ``source``: ``new``'s data source
    (:func:`captioning.model.data_sources.data_source`; default: the images), asked whether its encoder is pooled."""
    diff = [f"model.{k}" for k in ("decoder", "encoder", "region_feature_size", "box_geometry")
            if getattr(old.model, k) != getattr(new.model, k)]
    if diff:
        return diff
    cls, encoder = decoder_class(new.model.decoder), encoder_class(new.model.encoder)
    old_model, new_model = typed_model(old.model), typed_model(new.model)
    a, b = old_model.decoder_settings, new_model.decoder_settings
    diff = [f"model.{k}" for k in cls.incompatible_keys if getattr(a, k) != getattr(b, k)]
    a, b = old_model.encoder_settings, new_model.encoder_settings
    diff += [f"model.{k}" for k in encoder.incompatible_keys if getattr(a, k) != getattr(b, k)]
    pooled = _images_unless(source, new.model).encoder_pooled(cls)
    if old.data.image_size != new.data.image_size and encoder.shapes_follow_image_size(b, pooled):
        diff.append(f"data.image_size (the shapes of model.encoder {new.model.encoder}'s variables follow it)")
    return diff


def build_model(vocab_size: int, cfg: ModelConfig, image_size: int, seed: int = 0,
                restoring: bool = False, source=None) -> CaptionModel:
    """The model of ``cfg.decoder`` over the encoder of ``cfg.encoder``, built here once, pooled or as tokens
    as the decoder reads it (a model reading regions keeps the encoder's tokens: it pools the regions of new
    images from them). Not built: call ``build_all()`` to create its variables. ``restoring``: a checkpoint
    brings the weights (the encoder loads none: nothing downloads). ``seed`` seeds the encoder's initial
    weights as the decoder's (:func:`~captioning.model.encoders.build_encoder`): one seed, one model. ``source``:
    the data source the model reads (:func:`captioning.model.data_sources.data_source`; default: the images),
    asked whether the encoder is pooled and trains, and held by the model (``model.source``)."""
    cfg = typed_model(cfg)
    cls = decoder_class(cfg.decoder)
    source = _images_unless(source, cfg)
    encoder = build_encoder(cfg, image_size, settings=cfg.encoder_settings, pooled=source.encoder_pooled(cls),
                            restoring=restoring, seed=seed)
    model = cls(vocab_size, cfg, encoder, seed=seed, settings=cfg.decoder_settings, source=source)
    if not source.encoder_trains:  # regions: the encoder (for new images' regions) is not trained
        model.encoder.trainable = False
    return model


__all__ = ["CaptionModel", "DECODERS", "ENCODERS", "PrefixLM", "ShowAndTell", "ShowAttendTell", "Transformer",
           "all_keys", "all_layers", "architecture_diff", "build_encoder", "build_model", "check_caption_length",
           "check_read", "decoder_class", "encoder_class", "resolve", "typed_model"]
