"""The composition root: a config typed once into an :class:`Experiment` that hands each stage its pieces.

The config loader (:mod:`captioning.config`, a base package) types the sections every stage reads —
``data:``, ``model:``'s shared keys, ``train:``, ``distribute:``, ``decode:`` — and keeps a component's own
keys as given, because the base imports no stage. This stage comes after the stages that own the
registries (``model``: decoders and encoders; ``train``: objectives), so it can ask each registry once:

1. :func:`typed` — the chosen decoder's and encoder's settings typed by their classes
   (:func:`captioning.model.resolve`: a key the user gave that neither reads is refused), every objective's
   section typed by its class (:func:`captioning.train.objectives.resolve`);
2. :func:`for_training` — then what the objective needs of the data brought in
   (:func:`captioning.train.objectives.fit_config`), the checks across sections, the caption lengths against
   the decoder, the prepared dataset opened and what the data source needs fitted from it (a features
   store's region size: :meth:`captioning.model.data_sources.base.DataSource.fitted`), ``data.tokenizer``
   resolved against the decoder (:attr:`Experiment.tokenizer_kind`); the tokenizer itself is made once, when a
   stage first asks for it (:attr:`Experiment.tokenizer`).

Stages take the pieces as arguments: :class:`~captioning.train.loop.Trainer` an experiment for training,
:func:`captioning.model.build_model` the typed model section (:meth:`Experiment.build_model`), decoding the
``decode:`` section. None of them types a key again, and the ``config.yaml`` a model folder keeps is
:meth:`Experiment.record`. A model folder's saved config is typed by the model stage that reads it
(``ModelDir.read_config``: the same ``captioning.model.resolve``, every key required, a missing one is damage). Everything here runs before TensorFlow's runtime starts (the registries' modules import
TensorFlow; nothing executes on a device).

How one setting travels, from YAML key to the layer that uses it, is docs/architecture.md's worked example.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing

from captioning import config as config_lib
from captioning.errors import InputError
from captioning.data.prepared import PreparedDataset
from captioning.data.tokenizers import build as build_tokenizer, choose as choose_tokenizer
from captioning.model import build_model, decoder_class, encoder_class, resolve
from captioning.model.data_sources import data_source, source_class
from captioning.model.folder import ModelDir
from captioning.train.objectives import check_caption_lengths, fit_config, objective_class
from captioning.train.objectives import resolve as resolve_objectives

log = logging.getLogger("captioning.experiment")


@dataclasses.dataclass(frozen=True)
class Chosen:
    """One registered component as the experiment chose it: its name (the config's value), its class (the
    registry's entry) and its settings (an instance of the class's ``settings_class``, or None)."""

    name: str
    cls: type
    settings: typing.Any


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A config with every section and every chosen component's settings typed (and, for training, fitted
    to its objective and data): what the stages are handed. ``dataset`` and ``extractor`` are set by
    :func:`for_training`: the prepared dataset the run reads, and for ``data.features: regions`` the
    checkpoint whose encoder pooled the features store's regions (None otherwise)."""

    config: config_lib.Config
    dataset: PreparedDataset | None = None
    extractor: str | None = None

    @property
    def decoder(self) -> Chosen:
        model = self.config.model
        return Chosen(model.decoder, decoder_class(model.decoder), model.decoder_settings)

    @property
    def encoder(self) -> Chosen:
        model = self.config.model
        return Chosen(model.encoder, encoder_class(model.encoder), model.encoder_settings)

    @property
    def objective(self) -> Chosen:
        name = self.config.train.objective
        cls = objective_class(name)
        return Chosen(name, cls, getattr(self.config, name) if cls.settings_class is not None else None)

    @property
    def decoding(self) -> config_lib.DecodeConfig:
        return self.config.decode

    def build_model(self, vocab_size: int, seed: int | None = None, restoring: bool = False):
        """The experiment's model (:func:`captioning.model.build_model`), seeded with ``train.seed`` unless
        ``seed`` says otherwise."""
        seed = self.config.train.seed if seed is None else seed
        return build_model(vocab_size, self.config.model, self.config.data.image_size, seed=seed, restoring=restoring,
                           source=self.source)

    @property
    def mixed_precision(self) -> bool:
        """Whether training computes in mixed precision: ``train.mixed_precision``, or the decoder's weights ask for it
        (:meth:`captioning.model.base.CaptionModel.mixed_precision`: a vision-language preset saved in bfloat16)."""
        decoder = self.decoder
        return bool(self.config.train.mixed_precision or decoder.cls.mixed_precision(decoder.settings))

    @property
    def tokenizer_kind(self) -> str:
        """``data.tokenizer`` resolved against the decoder (:func:`captioning.data.tokenizers.choose`): ``words`` or
        ``preset``; InputError for a setting the decoder cannot read."""
        decoder = self.decoder
        return choose_tokenizer(self.config.data.tokenizer, decoder.cls.tokenizer_preset(decoder.settings), decoder.name)

    @functools.cached_property
    def tokenizer(self):
        """The run's tokenizer (:mod:`captioning.data.tokenizers`), made once: the prepared dataset's vocabulary
        (``words``), or the decoder's preset's tokenizer (``preset``). The trainer, the input pipeline and the
        model folder take this one; ``len(tokenizer)`` is the model's vocabulary size."""
        kind, decoder = self.tokenizer_kind, self.decoder
        if kind == "words":
            dataset = self.dataset or PreparedDataset.load(self.config.data.dir)
            return build_tokenizer(kind, vocabulary=dataset.vocabulary())
        return build_tokenizer(kind, preset=decoder.cls.tokenizer_preset(decoder.settings))

    @functools.cached_property
    def source(self):
        """The data source (``data.features``: :func:`captioning.model.data_sources.data_source`), made once: the
        one the trainer asks and the model holds."""
        return data_source(self.config)

    def record(self) -> dict:
        """What a model folder's ``config.yaml`` keeps: every key, paths made absolute."""
        return config_lib.to_dict(config_lib.with_absolute_paths(self.config))


def typed(cfg: config_lib.Config, complete: bool = False) -> Experiment:
    """``cfg`` with the chosen decoder's and encoder's settings and every objective's section typed (``complete``:
    a saved config.yaml, which must hold every key). An InputError names a wrong key."""
    source_class(cfg.data.features)  # an unknown data.features is its own error, as an unknown decoder is
    return Experiment(resolve_objectives(resolve(cfg, complete), complete))


def load(path: str | None = None, overrides: typing.Sequence[str] = (), defaults: typing.Sequence[str] = ()
         ) -> Experiment:
    """The experiment of a config file, ``--set`` overrides and a program's ``defaults``
    (:func:`captioning.config.load_config`), typed (:func:`typed`)."""
    return typed(config_lib.load_config(path, overrides, defaults=defaults))


def for_training(cfg: config_lib.Config | Experiment) -> Experiment:
    """The experiment a training run takes: typed, then fitted to its objective (the batches it needs) and
    checked across sections (warnings for settings that do nothing), the caption lengths it decodes checked
    against the decoder, its prepared dataset opened (``data.dir``) and the data source's needs fitted from it
    (``data.features: regions``: the store's feature size, the encoder that pooled it). Writes nothing."""
    experiment = cfg if isinstance(cfg, Experiment) else typed(cfg)
    fitted = fit_config(experiment.config)
    config_lib.validate(fitted)
    tokenizer = Experiment(fitted).tokenizer_kind  # data.tokenizer against the decoder
    source = data_source(fitted)
    source.check()  # what data.features asks of the other sections
    for line in config_lib.ineffective(fitted) + source.ineffective():  # train.encoder_lr_scale, frozen encoder, ...
        log.warning("%s", line)
    check_caption_lengths(fitted)  # what evaluate decodes and what the objective decodes, against the decoder
    dataset = PreparedDataset.load(fitted.data.dir)
    if tokenizer != "words" and source.features_store(dataset) is not None:
        raise InputError(f"data.tokenizer: {tokenizer} tokenizes the records' caption text, and a features store "
                         f"holds only word ids (data.features: {fitted.data.features}): use data.features: images")
    fitted, extractor = source.fitted(dataset, ModelDir)
    return Experiment(fitted, dataset, extractor)


__all__ = ["Chosen", "Experiment", "for_training", "load", "typed"]
