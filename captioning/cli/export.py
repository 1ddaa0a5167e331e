"""``captioning export``: the flags, the output checked before the model loads, and the last line, which
says whether the export was written or found in place already (a rerun is a no-op)."""

from __future__ import annotations

import os

from captioning.cli.commands import _captioner, _decoding_given, add_model_dirs
from captioning.cli.parsing import call, decoding_flags


def add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="export a SavedModel (or a LiteRT .tflite file) that captions images",
        description="Writes a SavedModel whose serving signature takes a batch of encoded images (JPEG, PNG) "
                    "and returns the top captions and their log-probabilities, beam search inside. It loads "
                    "with tf.saved_model.load, without this project. With --format litert: one .tflite file "
                    "that captions one decoded uint8 image, the search inside, LiteRT built-in ops only "
                    "(docs/litert.md).")
    add_model_dirs(p)
    p.add_argument("--output", required=True,
                   help="the SavedModel folder to write (--format litert: the .tflite file)")
    p.add_argument("--format", choices=("savedmodel", "litert", "lora"), default="savedmodel",
                   help="savedmodel (default): a SavedModel folder; litert: one .tflite file for ai-edge-litert; "
                        "lora: the LoRA adapters alone, keras-hub's FILE.lora.h5 (Backbone.load_lora_weights)")
    p.add_argument("--quantize", choices=("none", "float16", "dynamic_int8"), default=None,  # litert.QUANTIZE
                   help="--format litert only: none (default, float32 weights), float16 weights, or dynamic_int8 "
                        "(int8 weights computed in float32, a few layers float16: docs/litert.md)")
    p.add_argument("--merge-lora", action="store_true",
                   help="merge the LoRA adapters the model trained (model.vlm_trainable: lora; prefix_lm's "
                        "model.lm_lora_rank) into the weights they adapt: the SavedModel holds no adapter")
    decoding_flags(p, top_k=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output if it holds an earlier export (never a folder or file of others)")
    p.set_defaults(handler=run_export)


def run_export(args) -> int:
    if args.merge_lora and args.format != "savedmodel":
        from captioning.errors import InputError

        raise InputError(f"--merge-lora applies to a SavedModel (--format savedmodel), not --format {args.format}",
                         params=("merge_lora",))
    if args.format == "litert":
        return _run_export_litert(args)
    if args.format == "lora":
        return _run_export_lora(args)
    if args.quantize is not None:
        from captioning.errors import InputError

        raise InputError("--quantize applies to --format litert only (a SavedModel keeps its float32 weights)",
                         params=("quantize",))
    from captioning.inference.export import MARKER, check_output, export

    _decoding_given(args)
    check_output(args.output, args.model_dir, args.overwrite)  # before the model loads
    before = _stamp(os.path.join(args.output, MARKER))
    output = call(export, args, captioner=_captioner(args))
    merged = " (the LoRA adapters merged into their weights)" if args.merge_lora else ""
    print(_exported(output, before, os.path.join(output, MARKER), merged))
    return 0


def _run_export_lora(args) -> int:
    from captioning.inference.export_lora import check_output, export_lora

    check_output(args.output, args.model_dir)  # before the model loads
    output, written = call(export_lora, args, captioner=_captioner(args))
    size = f"{os.path.getsize(output):,} bytes"
    print(f"exported the LoRA adapters to {output} ({size})" if written else
          f"already exported to {output} (the same LoRA adapters, {size})")
    return 0


def _stamp(path: str) -> tuple | None:
    """What tells a file rewritten (an export writes a new file and renames it over the old: a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _exported(output: str, before: tuple | None, marker: str, details: str = "") -> str:
    """The last line of ``export``: a rerun that found this very export in place wrote nothing, and says so."""
    if before is not None and _stamp(marker) == before:
        return f"already exported to {output} (unchanged: the same model, checkpoint and settings){details}"
    return f"exported to {output}{details}"


def _run_export_litert(args) -> int:
    from captioning.inference.litert import check_output, export_litert

    _decoding_given(args)
    args.quantize = args.quantize or "none"
    check_output(args.output, args.model_dir, args.overwrite)  # before the model loads
    before = _stamp(args.output)
    output = call(export_litert, args, captioner=_captioner(args))
    print(_exported(output, before, output, f" (LiteRT, {args.quantize}, {os.path.getsize(output):,} bytes; built-in "
                                            "ops only: no Flex delegate needed)"))
    return 0


