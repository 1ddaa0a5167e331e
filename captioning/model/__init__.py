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
from captioning.model.show_and_tell import ShowAndTell
from captioning.model.transformer import Transformer
from captioning.model.updown import UpDown

log = logging.getLogger("captioning.model")

DECODERS: dict[str, type[CaptionModel]] = {"show_and_tell": ShowAndTell, "attention": ShowAttendTell,
                                           "transformer": Transformer, "updown": UpDown}


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
    declares is left to :func:`settings_of` (unknown, with the nearest ones)."""
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


def settings_of(model_cfg: ModelConfig, complete: bool = False):
    """The chosen decoder's settings (an instance of its ``settings_class``), typed and checked.
    ``complete``: every one of them must be given (a saved config.yaml)."""
    cls = decoder_class(model_cfg.decoder)
    return settings_lib.section_from(cls.settings_class, _options_of(model_cfg, cls), "model.", complete=complete,
                                   where=f"the model section (decoder {model_cfg.decoder})")


def encoder_settings_of(model_cfg: ModelConfig, complete: bool = False):
    """The chosen encoder's settings (an instance of its ``settings_class``), typed and checked."""
    cls = encoder_class(model_cfg.encoder)
    return settings_lib.section_from(cls.settings_class, _options_of(model_cfg, cls), "model.", complete=complete,
                                   where=f"the model section (encoder {model_cfg.encoder})")


def resolve(cfg: config_lib.Config, complete: bool = False) -> config_lib.Config:
    """A copy of ``cfg`` whose ``model.options`` are exactly the decoder's and the encoder's settings, typed
    (every one of them, defaults included; the encoder's paths made absolute): what training records and
    compares. A key the user gave that neither reads is refused first (:func:`check_read`; not in a saved
    config.yaml, ``complete``, which holds theirs only)."""
    if not complete:
        check_read(cfg)
    out = copy.copy(cfg)
    encoder = encoder_settings_of(cfg.model, complete)
    for key in encoder_class(cfg.model.encoder).path_keys:  # a folder or file named relative to here, made absolute
        value = getattr(encoder, key)
        if value and os.path.exists(value):
            setattr(encoder, key, os.path.abspath(value))
    out.model = dataclasses.replace(cfg.model, options={**dataclasses.asdict(settings_of(cfg.model, complete)),
                                                        **dataclasses.asdict(encoder)})
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
    """Every decoder's and encoder's own keys, ``model.<name>``, each once."""
    return sorted({f"model.{f.name}" for cls in [*DECODERS.values(), *ENCODERS.values()]
                   for f in dataclasses.fields(cls.settings_class)})


def architecture_diff(old: config_lib.Config, new: config_lib.Config) -> list[str]:
    """The keys in which the models of two configs differ in their variables' shapes (a checkpoint of
    one does not fit the other): the decoder, the encoder, their ``incompatible_keys``, the image size where
    the encoder's shapes follow it (:meth:`~captioning.model.encoders.base.ImageEncoder.shapes_follow_image_size`);
    the size of the region features read and whether their boxes are added."""
    diff = [f"model.{k}" for k in ("decoder", "encoder", "region_feature_size", "box_geometry")
            if getattr(old.model, k) != getattr(new.model, k)]
    if diff:
        return diff
    cls, encoder = decoder_class(new.model.decoder), encoder_class(new.model.encoder)
    a, b = settings_of(old.model), settings_of(new.model)
    diff = [f"model.{k}" for k in cls.incompatible_keys if getattr(a, k) != getattr(b, k)]
    a, b = encoder_settings_of(old.model), encoder_settings_of(new.model)
    diff += [f"model.{k}" for k in encoder.incompatible_keys if getattr(a, k) != getattr(b, k)]
    pooled = cls.features == "pooled" and not new.model.region_feature_size
    if old.data.image_size != new.data.image_size and encoder.shapes_follow_image_size(b, pooled):
        diff.append(f"data.image_size (the shapes of model.encoder {new.model.encoder}'s variables follow it)")
    return diff


def build_model(vocab_size: int, cfg: ModelConfig, image_size: int, seed: int = 0,
                restoring: bool = False) -> CaptionModel:
    """The model of ``cfg.decoder`` over the encoder of ``cfg.encoder``, built here once, pooled or as tokens
    as the decoder reads it (a model reading regions keeps the encoder's tokens: it pools the regions of new
    images from them). Not built: call ``build_all()`` to create its variables. ``restoring``: a checkpoint
    brings the weights (the encoder loads none: nothing downloads). ``seed`` seeds the encoder's initial
    weights as the decoder's (:func:`~captioning.model.encoders.build_encoder`): one seed, one model."""
    cls = decoder_class(cfg.decoder)
    pooled = cls.features == "pooled" and not cfg.region_feature_size
    encoder = build_encoder(cfg, image_size, settings=encoder_settings_of(cfg), pooled=pooled, restoring=restoring,
                            seed=seed)
    model = cls(vocab_size, cfg, encoder, seed=seed, settings=settings_of(cfg))
    if model.reads_regions:  # training reads regions: the encoder (for new images' regions) is not trained
        model.encoder.trainable = False
    return model


__all__ = ["CaptionModel", "DECODERS", "ENCODERS", "ShowAndTell", "ShowAttendTell", "Transformer", "all_keys",
           "all_layers", "architecture_diff", "build_encoder", "build_model", "check_caption_length", "check_read",
           "decoder_class", "encoder_class", "encoder_settings_of", "resolve", "settings_of"]
