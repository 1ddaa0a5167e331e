"""``captioning export --format litert``: one ``.tflite`` file that captions a decoded image on a phone, the
search (greedy or beam) inside the graph, LiteRT built-in ops only (no Flex delegate).

Its one signature, ``serving_default``, takes ``image``: ``uint8 [height, width, 3]``, one decoded RGB image
of any size, upright (a camera frame, or a photo decoded and turned by its EXIF orientation, as ``caption`` turns
it), as the input tensor's name (:data:`INPUT_NAME`) and the metadata's ``"input"`` say; grey, RGBA or a batch fail
in the interpreter ("RESHAPE ... failed to prepare"): docs/litert.md's snippet converts them. Inside, each model's
own preprocessor (:attr:`captioning.model.folder.TrainedModel.preprocessor`, the one the input pipeline and the
SavedModel crop with) resizes it to ``data.resize_size`` in LiteRT built-in ops (:meth:`LiteRTGraph.pixels`: the
same pixels) and its central ``data.image_size`` crop is captioned, so it gives the SavedModel's captions for the
same pixels. It returns, best first (``top_k`` rows of ``decode.max_length`` words):

* ``ids`` ``int32 [top_k, max_length]``: the words' ids, 0 (``<pad>``) after the caption's end;
* ``lengths`` ``int32 [top_k]``: the number of words of each caption;
* ``log_probs`` ``float32 [top_k]``: each caption's summed log-probability (``<end>`` included);
* ``words`` ``string [top_k, max_length]``: the words themselves (a gather on the vocabulary, held in the
  file), ``<pad>`` after the caption's end: a caption is ``b" ".join(words[j, :lengths[j]])``; for a language-model
  decoder (``model.decoder: prefix_lm``, whose ids and lengths are its preset's pieces) ``pieces`` instead: each
  piece's bytes (``b""`` after the end), a caption their ``b"".join`` read as UTF-8 (``errors="replace"``), its runs
  of whitespace one space, stripped (what the SavedModel and ``caption`` give; its cache's writes, keras-hub's
  ``XlaDynamicUpdateSlice``, are the built-in ``DYNAMIC_UPDATE_SLICE``);
* an attention decoder's ``attention`` of the best caption, as the SavedModel gives it: ``float32
  [max_length, rows, cols]`` over the encoder's map (``attention_prefix`` ``[max_length, prefix]`` for a
  ViT's class token; ``[max_length, tokens]`` for an encoder without a layout), zeros after its last word.

Why a decoded image and not JPEG bytes: ``tf.io.decode_jpeg`` is not a LiteRT built-in op; with ``SELECT_TF_OPS``
it converts, but the ``ai-edge-litert`` wheel's interpreter has no Flex delegate and refuses it at run time
(measured with 2.3.0). Apps decode images with the platform's own decoder anyway.

What converts (the search's options are constants of the graph, as the export's ``decode:`` settings say):
greedy and beam search with every option (length penalty, n-gram blocking, bad endings, diverse groups),
every decoder and encoder, and ensembles (several ``--model-dir``: every model's weights in the file, each
model reading its own crop). Refused in one line, nothing written: ``decode.method=sample`` (its per-image
draws hash strings, ``tf.strings``, which are not built-in ops) and models reading regions
(``data.features: regions``: their pooling, ``tf.image.crop_and_resize``, is not a built-in op either).

``quantize``: ``none`` (float32 weights), ``float16`` (the converter's: weights stored as float16, computed in
float32) or ``dynamic_int8`` (Google's ``ai-edge-quantizer``: weights int8, computed in float32; but the vocabulary
projection, word embeddings and convolutions float16: :func:`captioning.inference.litert_int8.dynamic_int8`).

The file records what was exported in its own metadata (the flatbuffer's ``metadata`` entry :data:`METADATA`,
JSON: model folder, checkpoint, step, weights, decoding settings, ``quantize``, ``input``), so it stays one file,
written atomically (a temporary name, then a rename). The same export again is a no-op; another is replaced only
with ``overwrite``; a file without that metadata is never replaced; an output inside a model folder is refused.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import tensorflow as tf

from captioning.errors import InputError
from captioning.fileio import atomic_write_bytes, check_output_file, disk_full_error
from captioning.inference.captioner import Captioner
from captioning.inference.export import inside, trained_record
from captioning.inference.litert_int8 import FLOAT_OPS, SIZE_BOUND, dynamic_int8, packed, unpacked, unshared
from captioning.model.ensemble import model_dirs
from captioning.model.folder import ModelDir
from captioning.vocab import Vocabulary

QUANTIZE = ("none", "float16", "dynamic_int8")
METADATA = "captioning_export"  # the flatbuffer metadata entry holding the export's record
INPUT_CONTRACT = "uint8 [height, width, 3]: one RGB image, upright (EXIF orientation applied), any size"
INPUT_NAME = "image_uint8_height_width_3_upright_rgb"  # the input tensor's name: the contract, where tools show it


def refusal(captioner: Captioner) -> str | None:
    """Why ``captioner`` cannot become a LiteRT file of built-in ops (one line), or None."""
    if captioner.settings.method == "sample":
        return ("--format litert: decode.method=sample cannot be exported: its per-image random draws hash strings "
                "(tf.strings), which are not LiteRT built-in ops; export greedy or beam search")
    refusals = [member.model.source.litert_refusal for member in captioner.trained.members]  # its data source's
    return next((why for why in refusals if why), None)


class LiteRTGraph(tf.Module):
    """The graph the file holds: one decoded image → its captions (see the module docstring)."""

    def __init__(self, captioner: Captioner):
        super().__init__()
        self.captioner = captioner
        tokenizer = captioner.trained.vocab
        # a word vocabulary's words, or a subword tokenizer's pieces as bytes ("" for <pad>: module docstring)
        self.subword = not isinstance(tokenizer, Vocabulary)
        self.words = tf.constant([piece if isinstance(piece, bytes) else piece.encode() for piece in tokenizer.pieces()]
                                 if self.subword else list(tokenizer.words), tf.string)
        self.serve = tf.function(self._serve, input_signature=[tf.TensorSpec([None, None, 3], tf.uint8, name="image")],
                                 autograph=False)

    def pixels(self, image):
        """``uint8 [H, W, 3]`` → the ``uint8 [S, S, 3]`` crops the models read, one for each preprocessor (models of
        the same sizes share one), in the models' order: each model's preprocessor's
        :meth:`~captioning.data.preprocessor.ImagePreprocessor.pixels` in LiteRT built-in ops."""
        preprocessors = dict.fromkeys(member.preprocessor for member in self.captioner.trained.members)
        return {preprocessor: preprocessor.pixels(image, builtin_ops=True) for preprocessor in preprocessors}

    def _state(self, image):
        """The decoding state of ``image`` (an ensemble's: each model's, a tuple), a batch of one."""
        crops = self.pixels(image)
        states = [member.model.initial_state(member.model.encode(crops[member.preprocessor][None], training=False))
                  for member in self.captioner.trained.members]  # each model its own crop, as the Captioner's
        return states[0] if len(states) == 1 else tuple(states)

    def _serve(self, image):
        state = self._state(image)
        # the search traced for a batch of unknown size, as the Captioner's: its loop's shapes stay the same
        # (the state before it keeps its batch of one: Keras' recurrent layers convert only with a static one)
        specs = tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), state)
        search = tf.function(lambda s: self.captioner._generate(s, None), input_signature=[specs], autograph=False)
        out = search(state)
        ids = out["ids"][0]
        served = {"ids": ids, "lengths": out["lengths"][0], "log_probs": out["log_probs"][0],
                  "pieces" if self.subword else "words": tf.gather(self.words, ids)}
        if "attention" in out:  # the best caption's, as the SavedModel gives it
            weights, layout = out["attention"][0, 0], self.captioner.token_layout
            if layout is None:
                served["attention"] = weights
            else:
                steps = tf.shape(ids)[1]
                served["attention"] = tf.reshape(weights[:, layout.prefix:], [steps, layout.rows, layout.cols])
                if layout.prefix:
                    served["attention_prefix"] = weights[:, :layout.prefix]
        return served


def convert(captioner: Captioner, quantize: str = "none") -> bytes:
    """The ``.tflite`` flatbuffer of ``captioner`` (built-in ops only), without the export's metadata. An
    InputError when it cannot convert (:func:`refusal`, or an op the converter finds no built-in for)."""
    if quantize not in QUANTIZE:
        raise InputError(f"`quantize` must be one of {', '.join(QUANTIZE)}, got {quantize!r}", params=("quantize",))
    reason = refusal(captioner)
    if reason:
        raise InputError(reason)
    graph = LiteRTGraph(captioner)
    concrete = graph.serve.get_concrete_function()
    # From the function itself, which the converter freezes (the variables, those the search's loop reads too, as
    # constants: convert_variables_to_constants_v2, its control flow kept) and converts as a graph. Its default
    # route writes a SavedModel and loads it twice first; without it the export command takes 0.90 of the CPU on
    # the demo model (benchmarks/RESULTS.md, 2026-11-26 18:12), less on larger graphs.
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], graph)
    converter.experimental_lower_to_saved_model = False
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if quantize == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    try:
        data = converter.convert()
    except Exception as e:  # the converter's ConverterError: name the ops without a built-in kernel
        ops = sorted(set(re.findall(r"'(tf\.\w+)' op is neither a custom op nor a flex op", str(e))))
        if not ops:
            raise
        raise InputError(f"--format litert: the model needs TensorFlow ops that are not LiteRT built-in ops "
                         f"({', '.join(ops)}): it would need the Flex delegate, which ai-edge-litert's interpreter "
                         "lacks; use the SavedModel export") from None
    # a graph's conversion names no signature: serving_default's, with the function's own names
    outputs = {tensor.name.split(":")[0]: name for name, tensor in concrete.structured_outputs.items()}
    data = with_signature(data, "serving_default", {"image": concrete.inputs[0].name.split(":")[0]}, outputs)
    if quantize == "dynamic_int8":  # a language model's embedding, left unread beside the loop: see unshared
        return dynamic_int8(unshared(data) if graph.subword else data)
    return data


def with_signature(data: bytes, key: str, inputs: dict[str, str], outputs: dict[str, str]) -> bytes:
    """The flatbuffer ``data`` of one subgraph with the signature ``key``: ``inputs`` maps each input's name to
    the name of the subgraph's input tensor, ``outputs`` each output tensor's name to the output's (sorted by
    name, as a SavedModel's conversion lists them)."""
    from ai_edge_litert import schema_py_generated as schema

    model = unpacked(data)
    subgraph = model.subgraphs[0]
    named = {subgraph.tensors[i].name.decode(): int(i) for i in list(subgraph.inputs) + list(subgraph.outputs)}

    def tensor_map(name, tensor):
        if tensor not in named:
            raise ValueError(f"the converted graph has no input or output tensor {tensor!r} (it has {sorted(named)})")
        entry = schema.TensorMapT()
        entry.name, entry.tensorIndex = name, named[tensor]
        return entry

    if key == "serving_default" and "image" in inputs:  # the input tensor's name states what it takes
        subgraph.tensors[named[inputs["image"]]].name = INPUT_NAME
    signature = schema.SignatureDefT()
    signature.signatureKey, signature.subgraphIndex = key, 0
    signature.inputs = [tensor_map(name, tensor) for name, tensor in sorted(inputs.items())]
    signature.outputs = [tensor_map(name, tensor) for tensor, name in sorted(outputs.items(), key=lambda kv: kv[1])]
    model.signatureDefs = [signature]
    return packed(model, len(data))


def with_metadata(data: bytes, record: dict) -> bytes:
    """The flatbuffer ``data`` with ``record`` (JSON) as its metadata entry :data:`METADATA`."""
    from ai_edge_litert import schema_py_generated as schema

    model = unpacked(data)
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(json.dumps(record, sort_keys=True).encode(), np.uint8)
    model.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = METADATA, len(model.buffers) - 1
    model.metadata = [m for m in (model.metadata or []) if m.name != METADATA.encode()] + [entry]
    return packed(model, len(data))


def read_record(path: str) -> dict | None:
    """The record a ``.tflite`` file written by this command holds (:data:`METADATA`), or None (another file:
    not a flatbuffer model, or one without it)."""
    from ai_edge_litert import schema_py_generated as schema

    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[4:8] != b"TFL3":
            return None
        model = schema.Model.GetRootAs(data, 0)
        for i in range(model.MetadataLength()):
            entry = model.Metadata(i)
            if entry.Name() == METADATA.encode():
                return json.loads(model.Buffers(entry.Buffer()).DataAsNumpy().tobytes())
    except (OSError, ValueError, IndexError, AttributeError, UnicodeDecodeError):
        return None
    return None


def check_output(output: str, model_dir, overwrite: bool = False) -> dict | None:
    """Refuses an ``output`` this export must not write, before any work (see the module docstring); returns
    the record of the export already there, or None when there is none."""
    target = os.path.realpath(output)
    for folder in model_dirs(model_dir):
        folder = os.path.realpath(folder)
        if inside(target, folder):
            raise InputError(f"`output` {output} is inside the model folder {folder}; write the .tflite file outside "
                             "it", params=("output",))
    if os.path.isdir(output):
        raise InputError(f"`output` {output} is a folder; --format litert writes one file (e.g. caption.tflite)",
                         params=("output",))
    for folder in model_dirs(model_dir):  # a preset it is built from
        ModelDir(folder).refuse_output(output, "`output`", params=("output",))
    check_output_file(output, "`output`", params=("output",))  # the shared rule: not empty, a regular file, ...
    if not os.path.exists(output):
        return None
    existing = read_record(output)
    if existing is None:
        raise InputError(f"`output` {output} is a file this command did not write (no {METADATA} metadata): "
                         "writing would destroy it; choose another name", params=("output",))
    return existing


def record_of(captioner: Captioner, model_dir, quantize: str) -> dict:
    """What the file records of its export (compared to tell a rerun)."""
    record = {"format": "litert", "quantize": quantize, **trained_record(captioner, model_dir), "flex_delegate": False,
              "input": {"image": INPUT_CONTRACT}}
    if quantize == "dynamic_int8":  # how: a file of an earlier recipe is another export
        record["quantizer"] = (f"ai-edge-quantizer weight_only_wi8_afp32, float16 ops {FLOAT_OPS}, word embeddings and "
                               f"convolutions (all within {SIZE_BOUND}x, else the small ones)")
    return record


def export_litert(captioner: Captioner, output: str, model_dir, quantize: str = "none",
                  overwrite: bool = False) -> str:
    """Writes the ``.tflite`` file of ``captioner`` to ``output`` (see the module docstring); returns
    ``output``. ``model_dir``: the model's folder, or its ensemble's (a list)."""
    reason = refusal(captioner)
    if reason:
        raise InputError(reason)
    record = record_of(captioner, model_dir, quantize)
    existing = check_output(output, model_dir, overwrite)
    if existing == record:
        return output  # this very export is there already
    if existing is not None and not overwrite:
        differ = sorted(k for k in {**existing, **record} if existing.get(k) != record.get(k))
        raise InputError(f"{output} holds another export ({existing.get('checkpoint')}, quantize "
                         f"{existing.get('quantize')}; it differs in {', '.join(differ)}); pass `overwrite=True` to "
                         "replace it", params=("overwrite",))
    data = with_metadata(convert(captioner, quantize), record)
    try:
        atomic_write_bytes(output, data)
    except OSError as e:
        raise disk_full_error(e, output, "the export") or e
    return output
