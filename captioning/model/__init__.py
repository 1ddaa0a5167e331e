"""The model stage: image encoders, decoders behind one interface, and decoding (beam search).

:func:`build_model` makes the model ``model.decoder`` names; everything downstream (training,
evaluation, captioning, export) uses only the :class:`CaptionModel` interface and
:func:`captioning.model.decode.beam_search`. A new decoder is a module here and an entry in
:data:`DECODERS` (and in ``model.decoder``'s choices in :mod:`captioning.config`).
"""

from __future__ import annotations

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model.base import CaptionModel
from captioning.model.encoders import SMALL_CNN_FILTERS, all_layers, build_encoder
from captioning.model.attention import ShowAttendTell
from captioning.model.show_and_tell import ShowAndTell

DECODERS: dict[str, type[CaptionModel]] = {"show_and_tell": ShowAndTell, "attention": ShowAttendTell}


def build_model(vocab_size: int, cfg: ModelConfig, image_size: int, seed: int = 0) -> CaptionModel:
    """The model of ``cfg.decoder`` (not built: call ``build_all()`` to create its variables)."""
    if cfg.decoder not in DECODERS:
        raise InputError(f"config key model.decoder must be one of {', '.join(DECODERS)}, got {cfg.decoder!r}")
    return DECODERS[cfg.decoder](vocab_size, cfg, image_size, seed=seed)


__all__ = ["CaptionModel", "DECODERS", "SMALL_CNN_FILTERS", "ShowAndTell", "ShowAttendTell", "all_layers",
           "build_encoder", "build_model"]
