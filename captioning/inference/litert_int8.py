"""The LiteRT export's ``dynamic_int8`` recipe (:func:`dynamic_int8`), and the flatbuffer helpers it shares with
:mod:`captioning.inference.litert` (:func:`unpacked`, :func:`packed`). docs/litert.md, "Quantization", has the
measurements behind each choice."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import numpy as np

FLOAT_OPS = r"(^|/)logits(_\d+)?/"  # the ops dynamic_int8 keeps in float16: each decoder's vocabulary projection
FLOAT32 = 0  # the flatbuffer schema's TensorType of float32 tensors
FLOAT16_CONV_WEIGHTS = 100_000  # a convolution of at most this many weights is stored float16 by dynamic_int8
SIZE_BOUND = 0.35  # dynamic_int8's file at most this fraction of the float32 file, as long as int8 gets it there


def unpacked(data: bytes):
    """The flatbuffer model ``data`` as ai-edge-litert's object API's ``ModelT``, every buffer's bytes inside it
    (a buffer stored after the flatbuffer, as ai-edge-quantizer and the converter of a large model write them, is
    read in: packing the object again writes only the flatbuffer)."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(bytearray(data), 0)
    for buffer in model.buffers:
        if buffer.offset > 1:
            buffer.data = np.frombuffer(data, np.uint8, buffer.size, buffer.offset)
            buffer.offset = buffer.size = 0
    return model


def packed(model, size: int) -> bytes:
    """The ``.tflite`` flatbuffer of ``model`` (a ``ModelT``, :func:`unpacked`'s), ``size`` about its bytes."""
    import flatbuffers

    builder = flatbuffers.Builder(size + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def small_convolutions(data: bytes, most: int | None = FLOAT16_CONV_WEIGHTS) -> list[str]:
    """The output tensor names of the ``CONV_2D`` ops of the float flatbuffer ``data`` whose filters hold at most
    ``most`` weights (the default :data:`FLOAT16_CONV_WEIGHTS`: the demo's ``small_cnn``'s first three of four;
    ``None``: every one)."""
    from ai_edge_litert import schema_py_generated as schema

    model = unpacked(data)
    names = []
    for subgraph in model.subgraphs:
        for op in subgraph.operators:
            code = model.operatorCodes[op.opcodeIndex]
            if max(code.builtinCode, code.deprecatedBuiltinCode) == schema.BuiltinOperator.CONV_2D:
                if most is None or int(np.prod(subgraph.tensors[op.inputs[1]].shape)) <= most:
                    names.append(subgraph.tensors[op.outputs[0]].name.decode())
    return names


def tables_float16(data: bytes) -> bytes:
    """The flatbuffer ``data`` with each ``GATHER``'s constant float32 table of 1,024 values or more (the word
    embedding) stored float16, a ``DEQUANTIZE`` to float32 before it in each subgraph that reads it (the interpreter
    dequantizes a constant once). ai-edge-quantizer casts no ``GATHER``'s table."""
    from ai_edge_litert import schema_py_generated as schema

    model = unpacked(data)
    ops = schema.BuiltinOperator
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
    if ops.DEQUANTIZE not in codes:
        code = schema.OperatorCodeT()
        code.builtinCode = code.deprecatedBuiltinCode = ops.DEQUANTIZE
        model.operatorCodes.append(code)
        codes.append(ops.DEQUANTIZE)
    halves = {}  # a float32 buffer → its float16 copy
    for subgraph in model.subgraphs:
        added = []
        for op in subgraph.operators:
            table = subgraph.tensors[op.inputs[0]] if codes[op.opcodeIndex] == ops.GATHER else None
            values = None if table is None else model.buffers[table.buffer].data
            if table is None or table.type != schema.TensorType.FLOAT32 or values is None or len(values) < 4096:
                continue
            if table.buffer not in halves:
                half = schema.BufferT()
                half.data = np.frombuffer(bytes(values), np.float32).astype(np.float16).view(np.uint8)
                model.buffers.append(half)
                halves[table.buffer] = len(model.buffers) - 1
            stored = schema.TensorT()
            stored.shape, stored.type = list(table.shape), schema.TensorType.FLOAT16
            stored.buffer = halves[table.buffer]
            stored.name = table.name + b"_float16"
            subgraph.tensors.append(stored)
            table.buffer = 0  # computed now: the DEQUANTIZE's output
            dequantize = schema.OperatorT()
            dequantize.opcodeIndex, dequantize.inputs = codes.index(ops.DEQUANTIZE), [len(subgraph.tensors) - 1]
            dequantize.outputs = [op.inputs[0]]
            added.append(dequantize)
        subgraph.operators = added + list(subgraph.operators)
    for buffer in halves:
        model.buffers[buffer].data = None
    return packed(model, len(data))


def unshared(data: bytes) -> bytes:
    """``data`` without the constants no operator reads that share their buffer with a tensor of another subgraph
    (each such tensor made one without data, which nothing reads); ``data`` itself when there is none. The
    converter leaves a ``prefix_lm``'s token embedding in the main subgraph, unread there, beside the search's loop
    body that reads it (the same buffer), and ai-edge-quantizer fails on it (a ``KeyError`` while it marks shared
    buffers for duplication: it has no results for a tensor no operator reads). :func:`captioning.inference.litert.convert`
    applies it to a language-model decoder's file alone (the other decoders' quantize as they are, their bytes kept).
    """
    model = unpacked(data)
    holders = {}
    for g, subgraph in enumerate(model.subgraphs):
        for tensor in subgraph.tensors:
            if tensor.buffer and model.buffers[tensor.buffer].data is not None:  # (buffer 0: no data)
                holders.setdefault(tensor.buffer, set()).add(g)
    dropped = 0
    for subgraph in model.subgraphs:
        read = {int(i) for op in subgraph.operators for i in (op.inputs if op.inputs is not None else ())}
        read |= {int(i) for i in list(subgraph.inputs) + list(subgraph.outputs)}
        for i, tensor in enumerate(subgraph.tensors):
            if i not in read and tensor.type == FLOAT32 and len(holders.get(tensor.buffer, ())) > 1:
                tensor.buffer, dropped = 0, dropped + 1
    return packed(model, len(data)) if dropped else data


def _quantized(data: bytes, convolutions: list[str]) -> bytes:
    """``data`` quantized by ai-edge-quantizer: weights int8, computed in float32; :data:`FLOAT_OPS` and
    ``convolutions`` float16, computed in float32; then :func:`tables_float16`."""
    from ai_edge_quantizer import qtyping, quantizer
    from ai_edge_quantizer.algorithm_manager import AlgorithmName

    ops = qtyping.TFLOperationName
    quant = quantizer.Quantizer(data)
    quant.add_weight_only_config(regex=".*", operation_name=ops.ALL_SUPPORTED, num_bits=8)  # weight_only_wi8_afp32
    float16 = qtyping.OpQuantizationConfig(  # weights stored float16, computed float32 (later rules win)
        weight_tensor_config=qtyping.TensorQuantizationConfig(num_bits=16, dtype=qtyping.TensorDataType.FLOAT),
        compute_precision=qtyping.ComputePrecision.FLOAT, explicit_dequantize=True)
    named = "|".join(map(re.escape, convolutions))
    for regex, op in [(FLOAT_OPS, ops.FULLY_CONNECTED)] + ([(f"^({named});$", ops.CONV_2D)] if named else []):
        quant.update_quantization_recipe(regex=regex, operation_name=op, op_config=float16,  # (an op's scope: its
                                         algorithm_key=AlgorithmName.FLOAT_CASTING)  # outputs' names, then ;)
    root, quiet = logging.getLogger(), io.StringIO()
    level = root.level
    root.setLevel(max(level, logging.WARNING))  # its "Serializing model..." line, logged at INFO on the root logger
    try:  # and its progress bar, which ai-edge-quantizer 0.10 shows for a large model whatever it is told
        with contextlib.redirect_stderr(quiet):
            result = quant.quantize(enable_progress_bar=False, enable_progress_report=False)
    finally:
        root.setLevel(level)
    return tables_float16(bytes(result.quantized_model))


def dynamic_int8(data: bytes, bound: float = SIZE_BOUND) -> bytes:
    """The float ``.tflite`` flatbuffer ``data`` with its weights int8 (per output channel, symmetric:
    ai-edge-quantizer's ``weight_only_wi8_afp32``), dequantized and computed in float32, but these stored float16:

    * the vocabulary projection (:data:`FLOAT_OPS`, the Dense layer ``logits``): int8 alone, it changed 8-13% of a
      demo model's best captions (it scores near-tied words, "big" or "large"), more than any other layer;
    * the word-embedding table (:func:`tables_float16`: 27 KB less than float32, which pays for the next);
    * the convolutions (the encoder's, run once an image): every one if the file stays within ``bound`` of
      ``data``'s size, else those of at most :data:`FLOAT16_CONV_WEIGHTS` weights (:func:`small_convolutions`).

    Int8 weights computed in float, not dynamic range int8 (activations quantized on the fly, int8 kernels): on three
    demo models, with the projection and small convolutions float16 in both, the int8 kernels moved a best caption's
    log-probability by 0.014 nats on average, float32 compute by 0.010; dynamic range quantization agreed with the
    SavedModel's best captions on 92-96% of the images, this recipe on 95-98%. The price: the interpreter holds the
    weights dequantized and runs as fast as on ``none``'s file (docs/litert.md).

    >>> import re
    >>> bool(re.search(FLOAT_OPS, "while/logits_1/MatMul;while/logits_1/BiasAdd"))
    True
    >>> bool(re.search(FLOAT_OPS, "while/lstm_cell_1/MatMul1"))
    False
    """
    quantized = _quantized(data, small_convolutions(data, None))
    if len(quantized) > bound * len(data):
        quantized = _quantized(data, small_convolutions(data))
    return quantized
