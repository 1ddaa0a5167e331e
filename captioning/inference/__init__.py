"""Using a trained model: captions for encoded images (``captioner``: what ``evaluate``, ``caption`` and
``export`` share), captions and a gallery for your files (``caption``), and a SavedModel that captions
without this project (``export``)."""

from captioning.inference.captioner import Caption, Captioner, load

__all__ = ["Caption", "Captioner", "load"]
