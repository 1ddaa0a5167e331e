"""The data source interface: what a model differs in by what it reads (``data.features``), in one place.

A data source (a subclass of :class:`DataSource`, registered in :data:`captioning.model.data_sources.DATA_SOURCES`
under ``data.features``'s name) is made from a config (:func:`captioning.model.data_sources.data_source`) and
answers, for every stage, what depends on the features a model reads — the stages ask it and never test its
name:

* the config: :meth:`~DataSource.check` (its rules across sections), :meth:`~DataSource.ineffective` (settings
  that do nothing with it), :meth:`~DataSource.evaluation_input` (what decides an evaluation's batches);
* training: :meth:`~DataSource.fitted` (the model's settings it fills in from the prepared dataset, and the
  checkpoint a new model's encoder starts from), :meth:`~DataSource.start_encoder`;
* the input (the data stage takes the source as an argument): :meth:`~DataSource.features_store` (what the
  pipeline reads instead of the JPEGs), :meth:`~DataSource.held_images` (the images of a split the input
  reads), :meth:`~DataSource.eval_batches` (evaluation order), :meth:`~DataSource.seen_regions`;
* the model (the model holds its source: ``model.source``): :meth:`~DataSource.encoder_pooled`,
  :attr:`~DataSource.encoder_trains`, :meth:`~DataSource.feature_depth`, :meth:`~DataSource.token_layout`,
  :attr:`~DataSource.tokens_have_places`, :meth:`~DataSource.probe_inputs`;
* inference (the captioner asks its models' sources): :attr:`~DataSource.takes_boxes` (a new image's
  caption needs its boxes: the captioner's and the SavedModel's inputs), :meth:`~DataSource.check_boxes`, and
  the refusals :attr:`~DataSource.litert_refusal` and :attr:`~DataSource.serve_refusal`.

The defaults here are a model reading its encoder's features of the images (:class:`~.images.Images`).
"""

from __future__ import annotations

import numpy as np

from captioning import config as config_lib


class DataSource:
    """What a model reading one kind of features differs in (module docstring). ``config``: the run's or the
    model folder's config (None: a source asked only about a model, as :func:`captioning.model.build_model`'s
    default)."""

    name = ""  # the value of data.features that chooses it
    takes_boxes = False  # a new image is captioned from its boxes too (caption --detections, the SavedModel's boxes)
    encoder_trains = True  # whether the model's encoder may train (model.encoder_trainable decides then)
    tokens_have_places = True  # whether what the decoder attends over has places (a Transformer's cell positions)
    reads_encoder_tokens = True  # whether the decoder reads the encoder's own tokens (not regions stored beside it)
    pixels = True  # whether a training batch holds the images' pixels ("image"; data.cache: features aside)
    litert_refusal: str | None = None  # why a model reading it cannot become a LiteRT file, or None
    serve_refusal: str | None = None  # why `captioning serve` cannot serve a model reading it, or None

    def __init__(self, config: config_lib.Config | None = None):
        self.config = config if config is not None else config_lib.Config()

    # ---- the config ------------------------------------------------------------------------------------
    def check(self) -> None:
        """InputError (one line) when the config's other sections do not fit this source."""

    def ineffective(self) -> list[str]:
        """One line for each setting that does nothing with this source (a warning)."""
        return []

    def evaluation_input(self) -> dict:
        """The keys that decide what evaluation gives the model for each image (models whose values agree read
        the same batches: an ensemble is evaluated over one input)."""
        d = self.config.data
        return {"features": d.features, "image_size": d.image_size, "resize_size": d.resize_size}

    # ---- training ----------------------------------------------------------------------------------------
    def fitted(self, dataset, model_folder) -> tuple[config_lib.Config, str | None]:
        """The config with the model settings this source fills in from ``dataset`` (a
        :class:`~captioning.data.prepared.PreparedDataset`), and the checkpoint a new model's encoder starts
        from (None: none). ``model_folder``: :class:`captioning.model.folder.ModelDir`, handed over by the caller
        (the model folder builds its model through this registry, so a source cannot import it)."""
        return self.config, None

    def start_encoder(self, model, checkpoint: str, model_folder) -> None:
        """Copies the encoder of the model at ``checkpoint`` (:meth:`fitted`'s) into ``model``'s."""
        raise NotImplementedError(f"data.features {self.name} starts no encoder from a checkpoint")

    # ---- the input -------------------------------------------------------------------------------------
    def features_store(self, dataset):
        """The :class:`~captioning.data.features_store.FeaturesStore` the input pipeline reads instead of the
        images of ``dataset``, or None (the images)."""
        return None

    def held_images(self, dataset, split: str) -> int | None:
        """How many images of ``split`` the input reads (None: all of them)."""
        return None

    def eval_batches(self, split: str, batch_size: int, *, max_images: int | None = None, dataset=None,
                     shards=None, preprocessor=None):
        """Batches of ``split`` in evaluation order, as the model reads them, with ``image_id`` and ``captions``
        (:func:`captioning.data.reading.eval_images`)."""
        from captioning.data.reading import eval_images

        return eval_images(self.config.data, split, batch_size, max_images=max_images, dataset=dataset,
                           shards=shards, preprocessor=preprocessor)

    def seen_regions(self, batch: dict, row: int) -> np.ndarray | None:
        """The boxes ``[n, 4]`` (fractions of the image) of row ``row``'s regions in a batch of
        :meth:`eval_batches`, or None for a model that reads no regions."""
        return None

    # ---- the model -------------------------------------------------------------------------------------
    def encoder_pooled(self, decoder_class) -> bool:
        """Whether the encoder is built pooled (a vector per image) for a decoder of ``decoder_class``."""
        return decoder_class.features == "pooled"

    def feature_depth(self, encoder_depth: int) -> int:
        """The depth of what the decoder reads, from the encoder's."""
        return encoder_depth

    def token_layout(self, encoder):
        """Where the tokens the decoder reads sit (a :class:`~captioning.model.layout.TokenLayout`), or None."""
        return encoder.layout

    def probe_inputs(self, image_size: int) -> dict:
        """The image inputs of a batch of one image, for the tiny pass that creates a model's variables."""
        return {"image": np.zeros((1, image_size, image_size, 3), "uint8")}

    # ---- inference ---------------------------------------------------------------------------------------
    def check_boxes(self, model_dir: str) -> None:
        """InputError when a model reading this source cannot caption new images from their boxes."""
