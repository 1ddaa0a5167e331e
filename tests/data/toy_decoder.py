"""A decoder that is not part of the project: a GRU over the pooled image features, the smallest thing the
decoder interface allows. tests/test_decoders.py registers it from this file (``--decoder FILE:NAME``)
and runs the contract suite on it, as it would on a new decoder added to ``captioning.model``; with
``BROKEN=1`` in the environment its teacher-forced pass differs from stepping, and the suite must fail."""

import os
from dataclasses import dataclass, field

import tensorflow as tf
from keras import layers

from captioning.config.settings import MAX_WIDTH, between
from captioning.model.base import CaptionModel


@dataclass
class ToySettings:
    units: int = field(default=64, metadata=between(1, MAX_WIDTH))


class Toy(CaptionModel):
    settings_class = ToySettings
    incompatible_keys = ("units",)
    features = "pooled"
    tiny_settings = {"units": 12}

    def __init__(self, vocab_size, cfg, encoder, seed=0, settings=None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        units = self.settings.units
        self.project = layers.Dense(units, activation="tanh", name="project")
        self.embed = layers.Embedding(vocab_size, units, name="embed")
        self.gru = layers.GRU(units, return_sequences=True, return_state=True, name="gru")
        self.logits = layers.Dense(vocab_size, dtype="float32", name="logits")

    def initial_state(self, features, training=False, mask=None):
        return [self.project(features)]

    def step(self, token_ids, state):
        output, h = self.gru(self.embed(token_ids)[:, None, :], initial_state=state)
        return self.logits(output[:, 0]), [h]

    def teacher_forced(self, state, input_ids, training=False):
        outputs, h = self.gru(self.embed(input_ids), initial_state=state, training=training)
        if os.environ.get("BROKEN"):
            outputs = outputs + 1e-3  # a subtle bug: the contract catches it
        return self.logits(outputs), [h]

    def decoder_variables(self):
        return [v for layer in (self.project, self.embed, self.gru, self.logits) for v in layer.weights]


DECODER = Toy
