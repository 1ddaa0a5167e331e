"""``data.features: regions``: the model reads a features store's regions and boxes instead of its encoder's grid.

Everything a model reading boxes differs in is here, asked by the stages (:mod:`.base`):

* **the config**: a features store is on disk already, so ``data.cache`` is ``none`` or ``memory``; the
  encoder is not trained, so ``train.encoder_lr_scale`` does nothing; what decides an evaluation's batches is
  the store (``data.features_store``), not the image sizes;
* **fitted from the store** (:meth:`Regions.fitted`): ``model.region_feature_size`` (the store's; a config that
  gives another is refused), ``model.regions_from_encoder`` and the checkpoint a new model's encoder starts
  from. A model reading regions never trains its encoder; it keeps one so that it can pool the regions of new
  images (``caption --detections``, the SavedModel). When the store was written by ``captioning features
  extract`` with an encoder like the model's (the same ``model.encoder`` and ``data.image_size``), a new model
  starts its encoder from that checkpoint and records ``model.regions_from_encoder: true`` (extracted with a
  config's encoder — ``--config`` — the model builds the same one from the same weights file or ImageNet's);
  for imported features (bottom-up, a detector this project cannot run) it records false, and captions only
  images of the store;
* **the input**: the store's shards (:mod:`captioning.data.region_input`), its images only;
* **the model**: the encoder keeps its tokens (it pools new images' regions from them) and is frozen; the
  decoder reads ``model.region_feature_size`` features a region (plus its box with ``model.box_geometry``),
  which have no layout and no places (a set: their places are in their boxes);
* **inference**: a new image is captioned from its boxes (the captioner's and the SavedModel's ``boxes``), only
  by a model whose encoder pooled its regions; neither LiteRT nor the server can take boxes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from captioning.config.sections import TrainConfig
from captioning.data.region_input import eval_regions, store_of
from captioning.errors import InputError
from captioning.model import decoder_class, encoder_class
from captioning.model.base import GEOMETRY
from captioning.model.data_sources.base import DataSource

log = logging.getLogger("captioning.train")


class Regions(DataSource):
    """A features store's regions and boxes (module docstring)."""

    name = "regions"
    takes_boxes = True
    encoder_trains = False
    tokens_have_places = False
    reads_encoder_tokens = False
    pixels = False
    litert_refusal = ("--format litert: a model reading regions (data.features: regions) cannot be exported: its "
                      "region pooling (tf.image.crop_and_resize) is not a LiteRT built-in op; use the SavedModel "
                      "export")
    serve_refusal = ("the model reads regions, which need each image's boxes from a detector: `captioning serve` "
                     "takes images alone (use `captioning caption --detections`)")

    # ---- the config ------------------------------------------------------------------------------------
    def check(self) -> None:
        data = self.config.data
        if data.cache in ("disk", "features"):
            raise InputError(f"data.cache: {data.cache} caches decoded images or their encoder features; "
                             "data.features: regions reads a features store, which is on disk already: use "
                             "data.cache: none or memory")

    def ineffective(self) -> list[str]:
        train, model = self.config.train, self.config.model
        if train.encoder_lr_scale != TrainConfig().encoder_lr_scale and model.encoder_trainable:
            return [f"train.encoder_lr_scale {train.encoder_lr_scale:g} does nothing: the encoder is not trained "
                    "when the decoder reads regions (data.features: regions)"]
        return []

    def evaluation_input(self) -> dict:
        return {"features": self.name, "features_store": self.config.data.features_store}

    # ---- training ----------------------------------------------------------------------------------------
    def fitted(self, dataset, model_folder):
        """The config with ``model.region_feature_size`` set to its features store's and
        ``model.regions_from_encoder``, and the checkpoint whose encoder pooled the store's regions when it is
        an encoder like this model's (its weights are where a new model's encoder starts, so it can pool the
        regions of new images; None otherwise, or for a config's encoder, which the model builds with the same
        weights). An InputError when the config gives another feature size, or asks for ``model.box_geometry``
        from a store without boxes (imported from a source that gave none: its boxes are zeros, which would
        train the model on nothing)."""
        cfg = self.config
        store = store_of(cfg.data, dataset)
        given = cfg.model.region_feature_size
        if given and given != store.feature_size:
            raise InputError(f"model.region_feature_size is {given}, but the features store {store.path} holds "
                             f"regions of {store.feature_size} features: leave the key out (training sets it)")
        if cfg.model.box_geometry and not store.has_boxes:
            raise InputError(f"model.box_geometry appends each region's box to its features, but the features "
                             f"store {store.path} holds no boxes (its source gave none): set model.box_geometry: "
                             "false, or import the features with their boxes")
        same, extractor = self._extractor(store, model_folder)
        model = dataclasses.replace(cfg.model, region_feature_size=store.feature_size, regions_from_encoder=same)
        return dataclasses.replace(cfg, model=model), extractor

    def _extractor(self, store, model_folder) -> tuple[bool, str | None]:
        """Whether the config's encoder is the one a store of ``captioning features extract`` pooled its regions
        with, and the checkpoint to start it from (None: a config's encoder, which the config builds with the
        same weights); (False, None), said in a log line, otherwise."""
        cfg, source = self.config, store.get("source") or {}
        if source.get("kind") != "extract":
            log.info("the regions of %s were imported: this model will caption new images only from such "
                     "features, not from boxes (caption --detections)", store.path)
            return False, None
        if "encoder" in source:  # a config's encoder: the same encoder, weights, size and settings build the same one
            ours = encoder_class(cfg.model.encoder).source(cfg.model, cfg.data.image_size,
                                                           cfg.model.encoder_settings)  # typed by the experiment
            same = source["encoder"] == ours and ours["encoder_weights"] != "none"
            if not same:
                log.warning("the regions of %s were pooled by %s, not by this model's encoder (%s; random weights "
                            "are never the same twice): this model will not caption new images from boxes",
                            store.path, source["encoder"], ours)
            return same, None
        folder = model_folder(str(source.get("model")))
        checkpoint = folder.checkpoint(int(source.get("checkpoint", -1)))
        theirs = folder.read_config() if os.path.exists(checkpoint + ".index") else None
        if theirs is None or (theirs.model.encoder, theirs.data.image_size) != (cfg.model.encoder,
                                                                               cfg.data.image_size):
            log.warning("the encoder %s pooled the regions of %s with is %s: this model will not caption new images "
                        "from boxes (caption --detections)", checkpoint, store.path,
                        "gone" if theirs is None else f"{theirs.model.encoder} at {theirs.data.image_size} px, not "
                                                      f"{cfg.model.encoder} at {cfg.data.image_size} px")
            return False, None
        pooled = decoder_class(theirs.model.decoder).features == "pooled"
        if not encoder_class(cfg.model.encoder).same_tokens(pooled, False):
            log.warning("the encoder %s pooled the regions of %s with gives other tokens when its decoder reads "
                        "pooled features (model.decoder %s): this model will not caption new images from boxes",
                        checkpoint, store.path, theirs.model.decoder)
            return False, None
        return True, checkpoint

    def start_encoder(self, model, checkpoint: str, model_folder) -> None:
        """Copies the encoder of the model at ``checkpoint`` (the one a features store's regions were pooled
        with) into ``model``'s, which then pools the regions of new images as the store's were pooled."""
        theirs = model_folder(os.path.dirname(checkpoint)).load(checkpoint).model.image_encoder.tokens_model().weights
        ours = model.image_encoder.tokens_model().weights
        if [tuple(v.shape) for v in theirs] != [tuple(v.shape) for v in ours]:
            raise InputError(f"the encoder of {checkpoint} does not fit this model's ({len(theirs)} against "
                             f"{len(ours)} weights)")
        for source, target in zip(theirs, ours):
            target.assign(source.numpy())
        log.info("the encoder starts from %s, which pooled the regions it reads", checkpoint)

    # ---- the input -------------------------------------------------------------------------------------
    def features_store(self, dataset):
        return store_of(self.config.data, dataset)

    def held_images(self, dataset, split: str) -> int:
        return self.features_store(dataset).split(split).images

    def eval_batches(self, split: str, batch_size: int, *, max_images: int | None = None, dataset=None,
                     shards=None, preprocessor=None):
        from captioning.data.prepared import PreparedDataset

        dataset = dataset or PreparedDataset.load(self.config.data.dir)
        return eval_regions(self.config.data, split, self.features_store(dataset), batch_size, max_images=max_images)

    def seen_regions(self, batch: dict, row: int) -> np.ndarray:
        real = int(batch["region_mask"][row].numpy().sum())
        return batch["boxes"][row, :real].numpy()

    # ---- the model -------------------------------------------------------------------------------------
    def encoder_pooled(self, decoder_class) -> bool:
        return False  # its tokens: it pools the regions of new images from them

    def feature_depth(self, encoder_depth: int) -> int:
        model = self.config.model
        return model.region_feature_size + (GEOMETRY if model.box_geometry else 0)

    def token_layout(self, encoder):
        return None

    def probe_inputs(self, image_size: int) -> dict:
        return {"regions": np.zeros((1, 1, self.config.model.region_feature_size), "float16"),
                "boxes": np.zeros((1, 1, 4), "float32"), "region_mask": np.ones((1, 1), "float32")}

    # ---- inference ---------------------------------------------------------------------------------------
    def check_boxes(self, model_dir: str) -> None:
        if not self.config.model.regions_from_encoder:
            raise InputError(f"the model in {model_dir} reads the regions of the features store "
                             f"{self.config.data.features_store!r}, which were not pooled by its encoder (imported "
                             "features, or an extraction encoder unlike its own): it captions only images of that "
                             "store (`captioning evaluate`); captions from boxes need a model trained on regions of "
                             "`captioning features extract`")
