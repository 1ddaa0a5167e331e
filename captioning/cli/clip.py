"""``captioning clip train``: the flags, and the wiring of a prepared dataset's split and its tokenizer
(:func:`data_prep.lm_text.train_clip_bpe`) into :mod:`captioning.train.contrastive`, which trains and writes the
CLIP preset folder. The output is checked before any work, as ``lm train``'s is: the same run's preset makes the
command a no-op, another run's is replaced only with ``--overwrite``, a folder of other files never; a killed run
leaves no output."""

from __future__ import annotations

import argparse
import logging

from captioning.cli.parsing import MAX_SEED, options, within

log = logging.getLogger("captioning")

MAX_CLIP_STEPS = 10_000_000
MAX_CLIP_BATCH = 8_192
MAX_CLIP_LEARNING_RATE = 1.0


def add_clip(sub) -> None:
    p = sub.add_parser("clip", help="train a CLIP on a prepared dataset for evaluate --clip-preset (clip train)",
                       description="Contrastive image-text models the reference-free metrics and rewards read.")
    actions = p.add_subparsers(dest="clip", metavar="ACTION", required=True)
    q = actions.add_parser(
        "train", help="train a keras-hub CLIP and its tokenizer on a split's images and captions, as a preset folder",
        description="Learns a CLIP BPE tokenizer from the split's captions, trains a keras-hub CLIP of the size on "
                    "its images and captions with CLIP's contrastive loss, and writes them with save_to_preset to "
                    "--output, which evaluate --clip-preset reads. Logs the loss against chance and the "
                    "text-to-image recall@1 of the split's first 500 images. A rerun of a finished run is a no-op.",
        epilog="example:\n  captioning clip train --records runs/scenes/records --split train --steps 2000 "
               "--output runs/clip", formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--records", required=True, metavar="DIR", help="a prepared dataset folder (captioning prepare)")
    q.add_argument("--split", default="train", help="the split whose images and captions (default train)")
    q.add_argument("--size", default="tiny", help="tiny (CPU) or base (CLIP ViT-B/32's dimensions) (default tiny)")
    q.add_argument("--steps", type=within(1, MAX_CLIP_STEPS), default=2000,
                   help=f"training steps, at most {MAX_CLIP_STEPS:,} (default 2000)")
    q.add_argument("--batch-size", type=within(2, MAX_CLIP_BATCH), default=64,
                   help=f"images (each with one of its captions) per step, 2 to {MAX_CLIP_BATCH:,} (default 64)")
    q.add_argument("--learning-rate", type=within(1e-9, MAX_CLIP_LEARNING_RATE, float), default=5e-4,
                   help="AdamW's peak learning rate, at most 1 (default 5e-4)")
    q.add_argument("--seed", type=within(0, MAX_SEED), default=0,
                   help="seed of the weights, the order of the images and the captions drawn (default 0)")
    q.add_argument("--output", required=True, metavar="PRESET_DIR", help="the preset folder to write")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a CLIP this command wrote there with other settings or data")
    q.set_defaults(handler=run_clip_train)


def run_clip_train(args) -> int:
    from captioning.cli.lm import already_done
    from captioning.config import load_config
    from captioning.data.prepared import PreparedDataset
    from captioning.fileio import check_output_folder, clean_folder_leftovers
    from captioning.train.contrastive import SIZES, ClipSettings, finished, train_clip
    from data_prep.lm_text import sentences_of, train_clip_bpe

    settings = options(ClipSettings, args).check()
    check_output_folder(args.output, "`output`", params=("output",), read_folders={args.records: "the prepared dataset"},
                        contains=True)
    clean_folder_leftovers(args.output)  # what a killed save left
    dataset = PreparedDataset.load(args.records)
    dataset.split(args.split)  # an unknown split: one line
    data = {"prepared_dataset": dataset.identity, "split": args.split}
    if already_done(settings, data, args.output, args.overwrite, finished, command="clip train", what="CLIP",
                    source_key="data"):
        print(f"{args.output} already holds this CLIP (same settings and data): nothing to do")
        return 0
    sentences = sentences_of(dataset.caption_texts(args.split), f"the {args.split} captions of {args.records}",
                             ("records",))
    vocabulary, merges = train_clip_bpe(sentences, SIZES[settings.size]["vocabulary"])
    data_cfg = load_config(None, [f"data.dir={dataset.path}"]).data
    record = train_clip(data_cfg, args.split, {"vocabulary": vocabulary, "merges": merges}, settings, args.output,
                        data, progress=not args.quiet)
    figures = record["figures"]
    print(f"CLIP {settings.size} in {args.output}: final loss {figures['final_loss']:.3f} (chance "
          f"{figures['chance_loss']:.3f}), text-to-image recall@1 {figures['recall@1']:.3f}")
    return 0
