"""``captioning export``: a SavedModel that captions encoded images, beam search inside.

The serving signature (``serving_default``) takes ``images``: a 1-D batch of JPEG/PNG (or GIF/BMP) bytes, a
JPEG turned upright by its EXIF orientation inside the graph (:func:`captioning.data.reading.exif_orientation`:
a phone photo tagged "rotated 90°" is captioned as ``caption`` and ``serve`` caption it), and returns
``captions`` (``string [batch, top_k]``, best first) and ``log_probs``
(``float32 [batch, top_k]``); for an attention decoder also ``attention`` (``float32 [batch, max_length,
rows, cols]``: for each word of the best caption, its weights over the encoder's map, as its token layout
declares it; zeros after the caption's last word), and for an encoder with tokens before its map (a ViT's
class token) ``attention_prefix`` (``[batch, max_length, prefix]``: their weights; with the map's they sum to
1). For an encoder that declares no layout, ``attention`` is ``[batch, max_length, tokens]``. A model reading regions (``data.features: regions``) takes ``boxes`` too (``float32
[batch, n, 4]``: x, y, width, height in pixels of each image, as COCO detection results give them; a box of
no width or height is padding) and returns ``regions`` (``[batch, n + 1, 4]``: each box as x1, y1, x2, y2
fractions of the image, the whole image last) and ``attention`` over them (``[batch, max_length, n + 1]``).
**A second signature, ``serving_examples``**, takes what TF Serving and TFX clients send: ``examples``, a 1-D
batch of serialized ``tf.train.Example`` protos, each holding its image's encoded bytes under the key
``image/encoded`` (:data:`EXAMPLE_IMAGE_KEY`: the key of this project's own records and of the TF Object
Detection API's, so a record of a prepared dataset can be sent as it is), and, for a model reading regions,
its boxes under ``image/boxes`` (:data:`EXAMPLE_BOXES_KEY`: a float list, x, y, width, height in pixels per box,
flattened; an example without it is its whole image alone). It returns exactly what ``serving_default``
returns for those images (the examples are parsed with one ``tf.io.parse_example``, then the same function
runs). An example without ``image/encoded`` is an error of the whole call, as TF Serving reports a bad
request. ``saved_model_cli show --all --dir EXPORT`` lists both (docs/using.md shows its output).
An ensemble's export (several ``--model-dir``: :mod:`captioning.model.ensemble`) is one SavedModel holding
every model's weights, with the same signature (no ``attention``); its marker lists the models as
``"members"``. The SavedModel holds the serving functions and the variables they read, not the Keras models (their
layers are not objects of the loaded SavedModel), which saves and loads faster.
It runs the same function ``captioning caption`` runs
(:meth:`captioning.inference.captioner.Captioner.decode_encoded`), so the two give the same captions. The folder
loads with plain TensorFlow, without this project::

    serve = tf.saved_model.load("export/").signatures["serving_default"]
    out = serve(images=tf.constant([open("cat.jpg", "rb").read()]))
    out["captions"][0, 0].numpy().decode()

The captions are text in the graph, whatever the tokenizer (``data.tokenizer``): a word vocabulary's words are
gathered from a table of them and joined by spaces; a language model's pieces (``model.decoder: prefix_lm``: GPT-2's
byte-level BPE, SentencePiece) are detokenized by the tokenizer's own
:meth:`~captioning.data.tokenizers.base.Tokenizer.detokenize`, held in the SavedModel as a table of each id's
bytes: a gather, a join (a byte-level piece may be part of a character: the bytes are joined first), a UTF-8
check (an invalid sequence becomes U+FFFD) and the spaces normalised, all core TensorFlow ops — the loader needs
TensorFlow alone, not TensorFlow Text (whose ops keras-hub's tokenizers use to *split* text, which the export never
does) — so the captions equal ``captioning caption``'s (the Python ``decode``) for the same images.

Writing is safe for what is already on disk:

* The export goes to a temporary folder beside ``output`` and is swapped in only when complete: the old
  export is renamed aside, the new one renamed into place, the old one deleted. Whatever fails on the
  way (a full disk), ``output`` is the old export or the new one, and the temporary folder is removed.
* ``output`` holds ``captioning_export.json`` (:data:`MARKER`: the model folder, checkpoint, step, weights
  and decoding settings). ``weights``: ``"ema"`` when the SavedModel holds the checkpoint's weight average
  (``train.ema_decay``; the default when it has one, ``--weights raw`` for the weights as trained), else
  ``"raw"``. ``overwrite`` replaces only a folder holding that file, written by this command
  — never the model folder, a folder above it, the working directory or a folder above that, nor a
  folder of other files (as ``prepare --overwrite`` removes only its own files).
* Exporting the same checkpoint with the same settings into an export of them is a no-op.
* ``overwrite`` refuses an export folder holding files the export did not write (the marker lists the
  ones it wrote), rather than delete them with it; what an export killed on the way left beside
  ``output`` (``OUTPUT.tmp<pid>``, or the old export moved aside as ``OUTPUT.old<pid>``, which is put
  back) is cleaned up by the next export.
"""

from __future__ import annotations

import json
import logging
import os

import tensorflow as tf

from captioning.data.schema import IMAGE_ENCODED
from captioning.errors import InputError
from captioning.fileio import (atomic_folder, atomic_write_json, clean_folder_leftovers, disk_full_error,
                               refuse_inputs)
from captioning.inference.captioner import Captioner
from captioning.model.ensemble import model_dirs
from captioning.model.folder import ModelDir
from captioning.vocab import Vocabulary

log = logging.getLogger("captioning.inference.export")

MARKER = "captioning_export.json"
SIGNATURES = ("serving_default", "serving_examples")
EXAMPLE_IMAGE_KEY = IMAGE_ENCODED  # "image/encoded": the prepared records' key
EXAMPLE_BOXES_KEY = "image/boxes"
# what tf.saved_model.save writes, and the marker: an export of before "files" was recorded holds these
SAVED_MODEL_FILES = ("saved_model.pb", "variables", "assets", "fingerprint.pb", MARKER)


class CaptionServer(tf.Module):
    def __init__(self, captioner: Captioner):
        super().__init__()
        self.captioner = captioner
        # The models' variables, and not the models: the SavedModel needs only what its functions read, and saving
        # walks every object it is given (a Keras model: every layer), as loading recreates them: the export
        # command took 0.87 of the CPU it took before on the demo model (benchmarks/RESULTS.md, 2026-11-26 18:12),
        # more with more layers.
        held = {id(v): v for member in captioner.trained.members for v in member.model.variables}
        self.model_variables = list(held.values())
        tokenizer = captioner.trained.vocab
        # a word vocabulary's words gathered and joined; a subword tokenizer's pieces detokenized (module docstring)
        self.words = tf.constant(list(tokenizer.words)) if isinstance(tokenizer, Vocabulary) else None
        self.tokenizer = None if isinstance(tokenizer, Vocabulary) else tokenizer
        # the serving functions (tf.saved_model.save traces every tf.function of the module): images, or images
        # and boxes for a model reading regions; and the same from serialized tf.train.Examples
        images = tf.TensorSpec([None], tf.string, name="images")
        examples = [tf.TensorSpec([None], tf.string, name="examples")]
        if captioner.takes_boxes:
            self.serve = tf.function(self._serve_regions, input_signature=[
                images, tf.TensorSpec([None, None, 4], tf.float32, name="boxes")], autograph=False)
        else:
            self.serve = tf.function(self._serve_images, input_signature=[images], autograph=False)
        self.serve_examples = tf.function(self._serve_examples, input_signature=examples, autograph=False)

    def _serve_examples(self, examples):
        """Serialized ``tf.train.Example`` s ``[batch]``: the image bytes under :data:`EXAMPLE_IMAGE_KEY` (and a model
        reading regions: the boxes under :data:`EXAMPLE_BOXES_KEY`, x, y, width, height pixels, flattened)."""
        spec = {EXAMPLE_IMAGE_KEY: tf.io.FixedLenFeature([], tf.string)}
        if self.captioner.takes_boxes:
            spec[EXAMPLE_BOXES_KEY] = tf.io.VarLenFeature(tf.float32)
        parsed = tf.io.parse_example(examples, spec)
        # through self.serve, the tf.function: its one trace (the search) serves both signatures, which halves
        # the export's tracing and the graph it stores
        if not self.captioner.takes_boxes:
            return self.serve(parsed[EXAMPLE_IMAGE_KEY])
        flat = tf.sparse.to_dense(parsed[EXAMPLE_BOXES_KEY])  # [batch, 4 n]; zeros pad: boxes of no size
        boxes = tf.reshape(flat, [tf.shape(flat)[0], -1, 4])  # a length not a multiple of 4: an error of the call
        return self.serve(parsed[EXAMPLE_IMAGE_KEY], boxes)

    def _serve_images(self, images):
        out = self.captioner.decode_encoded(images)
        served = self._captions(out)
        if "attention" in out:  # the best caption's weights, per word, over the encoder's tokens
            layout, weights = self.captioner.token_layout, out["attention"][:, 0]
            if layout is None:  # tokens without places: as they are
                served["attention"] = weights
            else:  # the map's rows and columns; the prefix tokens (a class token) apart
                batch, steps = tf.shape(out["ids"])[0], tf.shape(out["ids"])[2]
                served["attention"] = tf.reshape(weights[..., layout.prefix:], [batch, steps, layout.rows, layout.cols])
                if layout.prefix:
                    served["attention_prefix"] = weights[..., :layout.prefix]
        return served

    def _serve_regions(self, images, boxes):
        """A model reading regions: ``boxes [batch, n, 4]`` (x, y, width, height pixels of each image; a box
        of no width or height is padding) beside the images."""
        out = self.captioner.decode_with_boxes(images, boxes)
        served = {**self._captions(out), "regions": out["boxes"]}
        if "attention" in out:  # the best caption's weights, per word, over the boxes and the whole image
            served["attention"] = out["attention"][:, 0]
        return served

    def _captions(self, out):
        ids, lengths = out["ids"], out["lengths"]
        batch, top_k, steps = tf.shape(ids)[0], tf.shape(ids)[1], tf.shape(ids)[2]
        if self.tokenizer is not None:  # pieces: their bytes joined, read as UTF-8, spaces normalised, in core ops
            kept = tf.sequence_mask(lengths, steps)
            flat = tf.reshape(tf.where(kept, ids, tf.zeros_like(ids)), [-1, steps])  # <pad> after each caption
            captions = tf.reshape(self.tokenizer.detokenize(flat), [batch, top_k])
            return {"captions": captions, "log_probs": out["log_probs"]}
        words = tf.RaggedTensor.from_tensor(tf.gather(self.words, tf.reshape(ids, [-1, steps])),
                                            lengths=tf.reshape(lengths, [-1]))
        captions = tf.reshape(tf.strings.reduce_join(words, axis=1, separator=" "), [batch, top_k])
        return {"captions": captions, "log_probs": out["log_probs"]}


def inside(path: str, folder: str) -> bool:
    """True when ``path`` is ``folder`` or lies inside it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def trained_record(captioner: Captioner, model_dir) -> dict:
    """What an export records of the model it holds: the (first) model folder, checkpoint, step, weights and
    decoding settings, and an ensemble's every model (``members``); the SavedModel's marker and the LiteRT
    file's metadata each add their own keys."""
    trained = captioner.trained
    record = {"model_dir": os.path.abspath(model_dirs(model_dir)[0]), "checkpoint": os.path.basename(trained.checkpoint),
              "step": trained.step, "weights": trained.members[0].weights, "decode": dict(captioner.options)}
    if len(trained.members) > 1:  # an ensemble: every model's
        record["members"] = [{"model_dir": os.path.abspath(m.model_dir), "checkpoint": os.path.basename(m.checkpoint),
                              "step": m.step, "weights": m.weights} for m in trained.members]
    return record


def check_output(output: str, model_dir, overwrite: bool) -> dict | None:
    """Refuses an ``output`` that export must never write (see the module docstring), before any work.
    Returns what the export already there records (its :data:`MARKER`), or None when there is none.
    ``model_dir``: a model folder, or an ensemble's (a list)."""
    refuse_inputs(output, "`output`", params=("output",))  # the shared rule (not empty; its inputs: below)
    target = os.path.realpath(output)
    dirs = model_dirs(model_dir)
    for path in dirs:  # its files, a preset it is built from
        ModelDir(path).refuse_output(output, "`output`", params=("output",))
    for what, folder in [("the model folder", path) for path in dirs] + [("the working directory", os.getcwd())]:
        if inside(os.path.realpath(folder), target):
            raise InputError(f"`output` {output} is {what} or a folder above it; export into a folder of its own",
                             params=("output",))
    if os.path.isfile(output) or (os.path.exists(output) and not os.path.isdir(output)):
        raise InputError(f"`output` {output} is a file; export writes a folder", params=("output",))
    if not os.path.isdir(output):
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            raise InputError(f"`output` {output}: its parent folder {parent} does not exist", params=("output",))
        probe = f"{target}.probe{os.getpid()}"  # only trying tells /proc, a read-only mount, a full disk
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as e:
            raise InputError(f"`output` {output}: cannot create a folder in {parent} ({e.strerror or e})",
                             params=("output",)) from None
        return None
    if not os.listdir(output):
        return None
    try:
        with open(os.path.join(output, MARKER), encoding="utf-8") as f:
            existing = json.load(f)
    except (OSError, ValueError):
        raise InputError(f"`output` {output} holds other files, not an export of this command (no {MARKER}); "
                         "choose another folder", params=("output",)) from None
    if overwrite:  # replacing it must not take along files somebody put there
        foreign = sorted(set(os.listdir(output)) - set(existing.get("files") or SAVED_MODEL_FILES))
        if foreign:
            raise InputError(f"`output` {output} holds files the export did not write ({', '.join(foreign[:3])}"
                             f"{', ...' if len(foreign) > 3 else ''}), which `overwrite=True` would delete with it: move "
                             "them out first", params=("output", "overwrite"))
    return existing


def merge_lora_adapters(captioner: Captioner) -> int:
    """Every LoRA adapter of ``captioner``'s models (each member of an ensemble) merged into the weights it adapts
    (:func:`captioning.model.lora.merge`): the layers merged. A model without adapters is an InputError (one line):
    ``--merge-lora`` would do nothing."""
    from captioning.model import lora

    backbones = [member.model.lora_backbone() for member in captioner.trained.members]
    if not any(b is not None for b in backbones):
        raise InputError(f"--merge-lora: the model has no LoRA adapters to merge ({lora.TRAINED_BY})",
                         params=("merge_lora",))
    return sum(lora.merge(b) for b in backbones if b is not None)


def export(captioner: Captioner, output: str, model_dir, overwrite: bool = False, merge_lora: bool = False) -> str:
    """Writes the SavedModel of ``captioner`` to ``output`` (see the module docstring); returns ``output``.
    ``model_dir``: the folder of ``captioner``'s model, or its ensemble's folders (a list). ``merge_lora``: its LoRA
    adapters merged into the weights they adapt first (:func:`merge_lora_adapters`; the marker says ``"lora":
    "merged"``)."""
    captioner.check_boxes()  # a model of imported regions cannot pool them from new images
    record = {**trained_record(captioner, model_dir), "signatures": list(SIGNATURES)}
    if merge_lora:
        log.info("merged the LoRA adapters of %d layers into their weights", merge_lora_adapters(captioner))
        record["lora"] = "merged"
    existing = check_output(output, model_dir, overwrite)
    if existing is not None:
        if {"weights": "raw", **{k: v for k, v in existing.items() if k != "files"}} == record:  # (older: raw)
            return output  # this very export is there already
        if not overwrite:
            raise InputError(f"{output} holds another export ({existing.get('checkpoint')}, "
                             f"{existing.get('decode')}); pass `overwrite=True` to replace it", params=("overwrite",))
    cleaned = clean_folder_leftovers(output)  # what an export killed mid-way left beside it
    if cleaned:
        log.info("removed what an interrupted export left: %s", ", ".join(cleaned))
    server = CaptionServer(captioner)
    try:
        with atomic_folder(output) as tmp:  # written beside, swapped in only when complete
            tf.saved_model.save(server, tmp, signatures={"serving_default": server.serve,
                                                         "serving_examples": server.serve_examples})
            atomic_write_json(os.path.join(tmp, MARKER), {**record, "files": sorted(os.listdir(tmp) + [MARKER])})
    except (OSError, tf.errors.OpError) as e:
        raise disk_full_error(e, output, "the export") or e
    return output
