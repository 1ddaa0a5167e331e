"""The data sources: what a model reads, as a registry keyed by ``data.features``.

:data:`DATA_SOURCES` maps ``data.features``'s values to :class:`~captioning.model.data_sources.base.DataSource`
subclasses: ``images`` (the encoder's features of the pixels, :mod:`.images`) and ``regions`` (a features store's
regions and boxes, :mod:`.regions`). :func:`data_source` makes the chosen one from a config; every stage asks it
(its checks, what training fills in from the dataset, the input, the model's encoder and tokens, the
captioner's inputs, the refusals) and none tests ``data.features``'s value. A new source is a module here with
a ``DataSource`` subclass and one entry in :data:`DATA_SOURCES`.

Where it sits: in the model stage, the first stage whose modules it needs (the encoder and decoder registries,
``GEOMETRY`` of :mod:`captioning.model.base`), after the data stage. The data stage takes a source as an
argument (:func:`captioning.data.pipeline.make_dataset`'s ``source``); a model holds its own (``model.source``,
given by :func:`captioning.model.build_model`, whose default is :class:`~.images.Images`); the model folder
(:mod:`captioning.model.folder`) makes one from its ``config.yaml`` to build its model, so a source cannot import
the folder: :meth:`~.base.DataSource.fitted` and :meth:`~.base.DataSource.start_encoder` take it as an argument.
"""

from __future__ import annotations

from captioning import config as config_lib
from captioning.config.settings import registered
from captioning.model.data_sources.base import DataSource
from captioning.model.data_sources.images import Images
from captioning.model.data_sources.regions import Regions

DATA_SOURCES: dict[str, type[DataSource]] = {"images": Images, "regions": Regions}


def source_class(name: str) -> type[DataSource]:
    """The registered data source ``name``; an InputError naming ``data.features`` and the choices otherwise."""
    return registered(DATA_SOURCES, "data.features", name)


def data_source(config: config_lib.Config) -> DataSource:
    """The registered source for ``config.data.features``, made from ``config``."""
    return source_class(config.data.features)(config)


__all__ = ["DATA_SOURCES", "DataSource", "Images", "Regions", "data_source", "source_class"]
