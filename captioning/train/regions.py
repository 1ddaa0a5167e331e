"""Training on regions (``data.features: regions``): the config fitted to its features store, and the encoder
the store's regions were pooled with.

A model reading regions never trains its encoder; it keeps one so that it can pool the regions of new
images (``caption --detections``, the SavedModel). When the store was written by ``captioning features
extract`` with an encoder like the model's (the same ``model.encoder`` and ``data.image_size``), a new model
starts its encoder from that checkpoint and records ``model.regions_from_encoder: true`` (extracted with a
config's encoder — ``--config`` — the model builds the same one from the same weights file or ImageNet's); for imported
features (bottom-up, a detector this project cannot run) it records false, and captions only images of the
store.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

from captioning import config as config_lib
from captioning.data.prepared import PreparedDataset
from captioning.data.region_input import store_of
from captioning.errors import InputError
from captioning.model import decoder_class, encoder_class, encoder_settings_of
from captioning.model.folder import ModelDir

log = logging.getLogger("captioning.train")


def regions_fitted(cfg: config_lib.Config, dataset: PreparedDataset) -> tuple[config_lib.Config, str | None]:
    """``cfg`` with ``model.region_feature_size`` set to its features store's and ``model.regions_from_encoder``
    (``data.features: regions``; as it is otherwise), and the checkpoint whose encoder pooled the store's
    regions when it is an encoder like this model's (its weights are where a new model's encoder starts, so
    it can pool the regions of new images; None otherwise, or for a config's encoder, which the model builds
    with the same weights). An InputError when the config gives another feature size, or asks for
    ``model.box_geometry`` from a store without boxes (imported from a source that gave none: its boxes are
    zeros, which would train the model on nothing)."""
    if cfg.data.features != "regions":
        return cfg, None
    store = store_of(cfg.data, dataset)
    given = cfg.model.region_feature_size
    if given and given != store.feature_size:
        raise InputError(f"model.region_feature_size is {given}, but the features store {store.path} holds "
                         f"regions of {store.feature_size} features: leave the key out (training sets it)")
    if cfg.model.box_geometry and not store.has_boxes:
        raise InputError(f"model.box_geometry appends each region's box to its features, but the features store "
                         f"{store.path} holds no boxes (its source gave none): set model.box_geometry: false, or "
                         "import the features with their boxes")
    same, extractor = _extractor(store, cfg)
    out = copy.copy(cfg)
    out.model = dataclasses.replace(cfg.model, region_feature_size=store.feature_size, regions_from_encoder=same)
    object.__setattr__(out, "_given", getattr(cfg, "_given", {}))
    return out, extractor


def _extractor(store, cfg: config_lib.Config) -> tuple[bool, str | None]:
    """Whether ``cfg``'s encoder is the one a store of ``captioning features extract`` pooled its regions with,
    and the checkpoint to start it from (None: a config's encoder, which ``cfg`` builds with the same weights);
    (False, None), said in a log line, otherwise."""
    source = store.get("source") or {}
    if source.get("kind") != "extract":
        log.info("the regions of %s were imported: this model will caption new images only from such features, "
                 "not from boxes (caption --detections)", store.path)
        return False, None
    encoder = encoder_class(cfg.model.encoder)
    if "encoder" in source:  # a config's encoder: the same encoder, weights, size and settings build the same one
        mine = encoder.source(cfg.model, cfg.data.image_size, encoder_settings_of(cfg.model))
        same = source["encoder"] == mine and mine["encoder_weights"] != "none"
        if not same:
            log.warning("the regions of %s were pooled by %s, not by this model's encoder (%s; random weights are "
                        "never the same twice): this model will not caption new images from boxes",
                        store.path, source["encoder"], mine)
        return same, None
    folder = ModelDir(str(source.get("model")))
    checkpoint = folder.checkpoint(int(source.get("checkpoint", -1)))
    theirs = folder.read_config() if os.path.exists(checkpoint + ".index") else None
    if theirs is None or (theirs.model.encoder, theirs.data.image_size) != (cfg.model.encoder, cfg.data.image_size):
        log.warning("the encoder %s pooled the regions of %s with is %s: this model will not caption new images "
                    "from boxes (caption --detections)", checkpoint, store.path,
                    "gone" if theirs is None else f"{theirs.model.encoder} at {theirs.data.image_size} px, not "
                                                  f"{cfg.model.encoder} at {cfg.data.image_size} px")
        return False, None
    if not encoder.same_tokens(decoder_class(theirs.model.decoder).features == "pooled", False):
        log.warning("the encoder %s pooled the regions of %s with gives other tokens when its decoder reads pooled "
                    "features (model.decoder %s): this model will not caption new images from boxes",
                    checkpoint, store.path, theirs.model.decoder)
        return False, None
    return True, checkpoint


def start_encoder_from(model, checkpoint: str) -> None:
    """Copies the encoder of the model at ``checkpoint`` (the one a features store's regions were pooled with)
    into ``model``'s, which then pools the regions of new images as the store's were pooled."""
    theirs = ModelDir(os.path.dirname(checkpoint)).load(checkpoint).model.image_encoder.tokens_model().weights
    mine = model.image_encoder.tokens_model().weights
    if [tuple(v.shape) for v in theirs] != [tuple(v.shape) for v in mine]:
        raise InputError(f"the encoder of {checkpoint} does not fit this model's ({len(theirs)} against "
                         f"{len(mine)} weights)")
    for a, b in zip(theirs, mine):
        b.assign(a.numpy())
    log.info("the encoder starts from %s, which pooled the regions it reads", checkpoint)
