"""``captioning export``: a SavedModel that captions encoded images, beam search inside.

The serving signature (``serving_default``) takes ``images``: a 1-D batch of JPEG/PNG (or GIF/BMP) bytes,
and returns ``captions`` (``string [batch, top_k]``, best first) and ``log_probs``
(``float32 [batch, top_k]``). It runs the same function ``captioning caption`` runs
(:meth:`captioning.inference.Captioner.decode_encoded`), so the two give the same captions. The folder
loads with plain TensorFlow, without this project::

    serve = tf.saved_model.load("export/").signatures["serving_default"]
    out = serve(images=tf.constant([open("cat.jpg", "rb").read()]))
    out["captions"][0, 0].numpy().decode()

The SavedModel is written to a temporary folder beside ``output`` and renamed when complete.
"""

from __future__ import annotations

import os
import shutil

import tensorflow as tf

from captioning.errors import InputError
from captioning.inference import Captioner


class CaptionServer(tf.Module):
    def __init__(self, captioner: Captioner):
        super().__init__()
        self.captioner = captioner
        self.model = captioner.trained.model
        self.words = tf.constant(list(captioner.trained.vocab.words))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="images")])
    def serve(self, images):
        out = self.captioner.decode_encoded(images)
        ids, lengths = out["ids"], out["lengths"]
        batch, top_k, steps = tf.shape(ids)[0], tf.shape(ids)[1], tf.shape(ids)[2]
        words = tf.RaggedTensor.from_tensor(tf.gather(self.words, tf.reshape(ids, [-1, steps])),
                                            lengths=tf.reshape(lengths, [-1]))
        captions = tf.reshape(tf.strings.reduce_join(words, axis=1, separator=" "), [batch, top_k])
        return {"captions": captions, "log_probs": out["log_probs"]}


def export(captioner: Captioner, output: str, overwrite: bool = False) -> str:
    if os.path.exists(output) and not overwrite:
        raise InputError(f"{output} exists; pass --overwrite to replace it")
    server = CaptionServer(captioner)
    tmp = f"{output.rstrip('/')}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(server, tmp, signatures={"serving_default": server.serve})
    if os.path.exists(output):
        shutil.rmtree(output)
    os.replace(tmp, output)
    return output
