"""``data.features: images`` (the default): the model reads its encoder's features of the images' pixels.

The input pipeline decodes each image's JPEG (:mod:`captioning.data.reading`), the encoder is built pooled or
as tokens as the decoder reads it and may train (``model.encoder_trainable``), the tokens keep the encoder's
layout and places, and a new image is captioned from its pixels alone — everything
:class:`~captioning.model.data_sources.base.DataSource` defaults to. What this source adds is its check: the
keys of a model reading regions (``model.box_geometry``, ``model.region_feature_size``) mean nothing here.
"""

from __future__ import annotations

from captioning.errors import InputError
from captioning.model.data_sources.base import DataSource


class Images(DataSource):
    """The images' pixels through the model's encoder (module docstring)."""

    name = "images"

    def check(self) -> None:
        model = self.config.model
        if model.box_geometry:
            raise InputError("model.box_geometry adds the regions' boxes to their features: it needs data.features: "
                             "regions")
        if model.region_feature_size:
            raise InputError(f"model.region_feature_size ({model.region_feature_size}) is the size of region "
                             "features: it needs data.features: regions")
