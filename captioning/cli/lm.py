"""``captioning lm train``: the flags, and the wiring of the text (:mod:`data_prep.lm_text`: a text file, or a
prepared dataset's captions through :class:`captioning.data.prepared.PreparedDataset`) and its tokenizer into
:mod:`captioning.train.language_model`, which trains and writes the preset folder.

The output is checked before any work (:func:`captioning.fileio.check_output_folder`: never the text file, never
inside or around the prepared dataset it reads). A folder holding the same run's preset (the same settings and
the same text, by its :data:`~captioning.train.language_model.RECORD`) makes the command a no-op; one of another
run is replaced only with ``--overwrite``; a folder of other files never. A killed run leaves no output (the
preset is written in a temporary folder renamed when complete; what a killed save left is cleared first).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os

from captioning.cli.parsing import MAX_SEED, options, within
from captioning.errors import InputError

log = logging.getLogger("captioning")

# the bounds of the sizes `lm train` takes (docs/reliability.md)
MAX_LM_STEPS = 10_000_000
MAX_LM_BATCH = 8_192
MAX_LM_SEQUENCE = 8_192
MAX_LM_LEARNING_RATE = 1.0
ARCHITECTURES = ("gpt2", "gemma")  # captioning.train.language_model.SIZES' keys


def add_lm(sub) -> None:
    p = sub.add_parser("lm", help="train a language model for model.decoder: prefix_lm (lm train)",
                       description="Language models a prefix_lm decoder starts from, made offline.")
    actions = p.add_subparsers(dest="lm", metavar="ACTION", required=True)
    q = actions.add_parser(
        "train", help="train a keras-hub causal LM and its tokenizer on text, written as a preset folder",
        description="Trains a tokenizer (GPT-2: byte-level BPE; Gemma: SentencePiece) and a keras-hub causal "
                    "language model of the architecture and size on text, and writes them with save_to_preset "
                    "to --output, which model.decoder_preset (and keras_hub's from_preset) reads. The text is a "
                    "plain text file, one sentence per line (captioning synth --text-only writes one), or a "
                    "prepared dataset folder (its captions of --split). Logs the loss, the held-out perplexity and "
                    "a greedy continuation. A rerun of a finished run is a no-op.",
        epilog="examples:\n"
               "  captioning synth --output-dir runs/text --scenes hard --num-images 100000 --text-only\n"
               "  captioning lm train --architecture gpt2 --size tiny --text runs/text/captions.txt --steps 3000 "
               "--output runs/lm\n"
               "  captioning lm train --architecture gemma --text runs/data --split train --output runs/lm_gemma",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--architecture", choices=ARCHITECTURES, default="gpt2",
                   help="gpt2 (byte-level BPE) or gemma (SentencePiece) (default gpt2)")
    q.add_argument("--size", default="tiny",
                   help="gpt2: tiny, small, base (GPT-2's); gemma: tiny, small, 2b (Gemma 2B's) (default tiny; "
                        "docs/language_models.md has the table)")
    q.add_argument("--text", required=True, metavar="FILE_OR_DIR",
                   help="a UTF-8 text file, one sentence per line, or a prepared dataset folder")
    q.add_argument("--split", default=None, help="with a prepared dataset: the split whose captions (default train)")
    q.add_argument("--steps", type=within(1, MAX_LM_STEPS), default=3000,
                   help=f"training steps, at most {MAX_LM_STEPS:,} (default 3000)")
    q.add_argument("--batch-size", type=within(1, MAX_LM_BATCH), default=32,
                   help=f"windows of text per step, at most {MAX_LM_BATCH:,} (default 32)")
    q.add_argument("--sequence-length", type=within(8, MAX_LM_SEQUENCE), default=64,
                   help="tokens per window, at least 8 and at most the size's positions (gpt2 tiny 128; default 64)")
    q.add_argument("--learning-rate", type=within(1e-9, MAX_LM_LEARNING_RATE, float), default=None,
                   help="AdamW's peak learning rate, at most 1 (default: tiny 1e-3, small 6e-4, base and 2b 3e-4)")
    q.add_argument("--seed", type=within(0, MAX_SEED), default=0,
                   help="seed of the weights, the held-out slice and the order of the text (default 0)")
    q.add_argument("--output", required=True, metavar="PRESET_DIR", help="the preset folder to write")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a language model this command wrote there with other settings or text")
    q.set_defaults(handler=run_lm_train)


def _text(path: str, split: str | None) -> tuple[dict, list[str] | None]:
    """What the text is, for telling a finished run (a file's SHA-256, or a prepared dataset's identity and split),
    and a file's sentences (read once; a dataset's are read by :func:`_dataset_sentences` when training runs)."""
    from captioning.data.prepared import PreparedDataset
    from data_prep.lm_text import read_text_file

    if os.path.isdir(path):
        dataset = PreparedDataset.load(path)
        dataset.split(split)
        return {"prepared_dataset": dataset.identity, "split": split}, None
    if split is not None:
        raise InputError(f"`split` is for a prepared dataset folder; `text` {path} is a file", params=("split", "text"))
    sentences = read_text_file(path)  # missing, not UTF-8, empty: one line now
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"file_sha256": digest.hexdigest(), "bytes": os.path.getsize(path)}, sentences


def _dataset_sentences(path: str, split: str) -> list[str]:
    from captioning.data.prepared import PreparedDataset
    from data_prep.lm_text import sentences_of

    return sentences_of(PreparedDataset.load(path).caption_texts(split), f"the {split} captions of `text` {path}",
                        ("text",))


def already_done(settings, source: dict, output: str, overwrite: bool, finished, command: str = "lm train",
                 what: str = "language model", source_key: str = "text") -> bool:
    """True when ``output`` holds this very run's preset (``finished(output)``: the record the command wrote, its
    ``settings`` and ``source_key`` those of this run); one line when it holds something it may not replace."""
    if not os.path.isdir(output) or not os.listdir(output):
        return False
    record = finished(output)
    if record is None:
        raise InputError(f"`output` {output} holds files `captioning {command}` did not write; give another "
                         "`output`", params=("output",))
    if record["settings"] == dataclasses.asdict(settings) and record[source_key] == source:
        return True
    if not overwrite:
        raise InputError(f"`output` {output} holds a {what} trained with other settings or {source_key}; pass "
                         "`overwrite=True` to replace it, or give another `output`", params=("output", "overwrite"))
    return False


def run_lm_train(args) -> int:
    from captioning.fileio import check_output_folder, clean_folder_leftovers
    from captioning.train.language_model import LMSettings, SIZES, finished, train_language_model
    from data_prep.lm_text import train_byte_level_bpe, train_sentencepiece

    settings = options(LMSettings, args).check()
    split = (args.split or "train") if os.path.isdir(args.text) else args.split
    reads = {args.text: "the prepared dataset"} if os.path.isdir(args.text) else {}
    check_output_folder(args.output, "`output`", params=("output",), inputs=[] if reads else [args.text],
                        read_folders=reads, contains=True)
    clean_folder_leftovers(args.output)  # what a killed save left
    text, sentences = _text(args.text, split)
    if already_done(settings, text, args.output, args.overwrite, finished):
        print(f"{args.output} already holds this language model (same settings and text): nothing to do")
        return 0
    sentences = sentences or _dataset_sentences(args.text, split)
    size = SIZES[settings.architecture][settings.size]["vocabulary"]
    log.info("training a %s tokenizer of at most %s pieces on %s sentences", settings.architecture, f"{size:,}",
             f"{len(sentences):,}")
    if settings.architecture == "gpt2":
        vocabulary, merges = train_byte_level_bpe(sentences, size)
        parts = {"vocabulary": vocabulary, "merges": merges}
    else:
        parts = {"proto": train_sentencepiece(sentences, size)}
    record = train_language_model(sentences, parts, settings, args.output, text, progress=not args.quiet)
    figures = record["figures"]
    print(f"{settings.architecture} {settings.size} language model in {args.output}: final training loss "
          f"{figures['final_loss']:.3f} (unigram entropy {figures['unigram_entropy']:.3f}), held-out perplexity "
          f"{figures['held_out_perplexity']:.2f}")
    return 0
