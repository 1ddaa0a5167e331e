"""Turning a trained model's step function into captions.

:func:`greedy_decode` picks the most likely word at each step, for all images of a batch at once, inside
one ``tf.function``. Captions stop at ``<end>`` or at ``max_length`` words.
"""

from __future__ import annotations

import tensorflow as tf

from captioning.vocab import END_ID, START_ID


def greedy_decode(model, images, max_length: int = 20, features=None) -> tf.Tensor:
    """Word ids ``[batch, max_length]`` (``<end>`` and what follows it are 0)."""
    if features is None:
        features = model.encode(images, training=False)
    state = model.initial_state(features, training=False)
    batch = tf.shape(features)[0]
    tokens = tf.fill([batch], tf.constant(START_ID, tf.int32))
    finished = tf.zeros([batch], tf.bool)
    words = tf.TensorArray(tf.int32, size=max_length)
    for t in tf.range(max_length):
        logits, state = model.step(tokens, state)
        tokens = tf.argmax(logits, axis=-1, output_type=tf.int32)
        finished = finished | tf.equal(tokens, END_ID)
        words = words.write(t, tf.where(finished, tf.zeros_like(tokens), tokens))
    return tf.transpose(words.stack())
