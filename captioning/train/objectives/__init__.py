"""Training objectives: what one replica's loss is on its share of the global batch.

:data:`OBJECTIVES` is the registry: ``train.objective`` names one of them. Each is a class in a module
of this package (:mod:`.base` has the interface: what an objective declares); a new objective is a new
module and one entry here. :func:`fit_config` makes a config fit the chosen objective (the batches it
needs, its own checks), :func:`objective_class` finds it.

An objective's own settings are the config section named after it (``scst:``), declared by its module as
a dataclass (:attr:`~.base.Objective.settings_class`). The config loader, which imports no stage, keeps
such a section as given (:class:`captioning.config.ComponentSection`); :func:`resolve` types and checks
it with the loader's own engine (:func:`captioning.config.settings.section_from`), for every objective that has
settings, whichever one the run trains with — as ``captioning.model.resolve`` does a decoder's keys.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

from captioning import config as config_lib
from captioning.config.sections import DataConfig
from captioning.errors import InputError
from captioning.config.settings import fields_of, section_from
from captioning.model import check_caption_length
from captioning.train.objectives.base import (Objective, ReplicaLoss, RunContext, caption_loss_sum,
                                              perplexity)
from captioning.train.objectives.scst import SelfCritical
from captioning.train.objectives.xe import CrossEntropy

log = logging.getLogger("captioning.train")

OBJECTIVES: dict[str, type[Objective]] = {"xe": CrossEntropy, "scst": SelfCritical}


def objective_class(name: str) -> type[Objective]:
    """The registered objective ``name``; an InputError naming ``train.objective`` otherwise."""
    if name not in OBJECTIVES:
        raise InputError(f"config key train.objective must be one of {', '.join(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]


def resolve(cfg: config_lib.Config, complete: bool = False) -> config_lib.Config:
    """``cfg`` with each objective's section typed: its settings dataclass in place of the section as the
    config gave it (a copy when any changes; a section typed already stays). An unknown key (the nearest
    ones named), a wrong type or a value out of range is an InputError naming ``<section>.<key>``.
    ``complete``: every key must be given (a saved config.yaml)."""
    out = cfg
    for name, cls in OBJECTIVES.items():
        if cls.settings_class is None or isinstance(getattr(cfg, name), cls.settings_class):
            continue
        given = getattr(cfg, name)
        settings = section_from(cls.settings_class, dict(given), f"{name}.", complete=complete,
                                where=f"the {name} section")
        if out is cfg:
            out = copy.copy(cfg)
        setattr(out, name, settings)
    return out


def all_keys() -> list[str]:
    """Every objective's own keys, ``<section>.<name>``."""
    return [f"{name}.{key}" for name, cls in OBJECTIVES.items() if cls.settings_class is not None
            for key in fields_of(cls.settings_class)]


def fit_config(cfg: config_lib.Config) -> config_lib.Config:
    """``cfg`` with the ``data.*`` settings its objective ``needs`` (a copy when it changes any). A
    setting that contradicts a need is brought to it when it holds its default and was not given with
    ``--set``, with one log line; otherwise it is an explicit choice the objective cannot train with,
    an InputError naming both keys. ``train.jit_compile: true`` from a config file is turned off for an
    objective whose step XLA cannot compile (``xla = False``: SCST), with one log line, so that
    ``--set train.objective=scst`` switches a config that compiles cross-entropy; given with ``--set``,
    it is refused. Then the objective's own :meth:`~Objective.check`. The objectives' sections are typed
    first (:func:`resolve`)."""
    cls = objective_class(cfg.train.objective)
    cfg = resolve(cfg)
    out = cfg
    defaults = DataConfig()
    for name, wanted in cls.needs.items():
        key, value = f"data.{name}", getattr(cfg.data, name)
        if value == wanted:
            continue
        if cfg.given(key) == "set" or value != getattr(defaults, name):
            how = "with --set" if cfg.given(key) == "set" else "in the config"
            raise InputError(f"train.objective: {cls.name} needs {key}: {wanted}, but {key} is {value} ({how}); "
                             f"leave {key} out, or set it to {wanted}")
        if out is cfg:
            out = copy.copy(cfg)
            out.data = dataclasses.replace(cfg.data)
        setattr(out.data, name, wanted)
        log.info("train.objective %s trains on %s: %s (set for this run)", cls.name, key, wanted)
    if out.train.jit_compile and not cls.xla:  # XLA for a whole step is a speed choice made for other objectives
        if cfg.given("train.jit_compile") == "set":
            raise InputError(f"train.jit_compile does not apply to train.objective: {cls.name}; set train.jit_compile: "
                             "false for it")
        if out is cfg:
            out = copy.copy(cfg)
        out.train = dataclasses.replace(cfg.train, jit_compile=False)
        log.info("train.objective %s does not compile its whole step with XLA: train.jit_compile: false for this "
                 "run", cls.name)
    cls.check(out)
    out.data.check("data.")
    return out


def check_caption_lengths(cfg: config_lib.Config) -> None:
    """One line (InputError) when a run would decode captions longer than its decoder can: what evaluate
    decodes (``decode.max_length``) and what the objective decodes itself (:meth:`Objective.caption_lengths`,
    e.g. SCST's ``scst.max_length``), each against :func:`captioning.model.check_caption_length`."""
    lengths = objective_class(cfg.train.objective).caption_lengths(cfg)
    for key, words in {"decode.max_length": cfg.decode.max_length, **lengths}.items():
        check_caption_length(cfg.model, key, words)


__all__ = ["OBJECTIVES", "CrossEntropy", "Objective", "ReplicaLoss", "RunContext", "SelfCritical", "all_keys",
           "caption_loss_sum", "check_caption_lengths", "fit_config", "objective_class", "perplexity", "resolve"]
