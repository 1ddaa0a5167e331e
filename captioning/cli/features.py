"""``captioning features import|extract``: the flags. Importing is :mod:`data_prep.features_import`;
extracting pools a model's encoder grid in a detector's boxes (:mod:`captioning.inference.regions`) and
writes through the same writer; both make a features store (:mod:`captioning.data.features_store`)."""

from __future__ import annotations

import argparse

import dataclasses
import os

from captioning.cli.parsing import config_flags, call, within

# the bounds of the sizes these commands take (documented in docs/data.md; the library checks them too)
MAX_IMAGES_PER_SHARD, MAX_CHECKPOINT_EVERY = 100_000, 1_000_000  # data_prep.features_writer's
MAX_BOXES, MAX_GRID_CELLS, MAX_FALSE_BOXES, MAX_SEED = 100, 10, 100, 2**32 - 1  # captioning.inference.regions'


def _shared(q) -> None:
    """The flags import and extract share: the store's name, shards, overwrite, checkpoints, the share kept."""
    q.add_argument("--name", default="regions", help="the store's name, a folder in DATA/features/ (default regions; "
                                                     "not starting with '.')")
    q.add_argument("--images-per-shard", type=within(1, MAX_IMAGES_PER_SHARD), default=1000,
                   help=f"images per shard, at most {MAX_IMAGES_PER_SHARD:,} (default 1000: ~150 MB of 36 regions × "
                        "2,048 float16 features)")
    q.add_argument("--overwrite", action="store_true", help="replace a store of this name from another source")
    q.add_argument("--checkpoint-every", type=within(1, MAX_CHECKPOINT_EVERY), default=500, metavar="ROWS",
                   help=f"rows of the source between checkpoints a rerun goes on from (default 500, at most "
                        f"{MAX_CHECKPOINT_EVERY:,})")
    q.add_argument("--allow-missing", action="store_true",
                   help="write the store even when it has features of fewer than half the dataset's images "
                        "(refused without it)")


def add_features(sub) -> None:
    p = sub.add_parser("features", help="region features beside a prepared dataset (import, extract)",
                       description="Region features for a prepared dataset, kept in a features store inside it "
                                   "(DATA/features/NAME/).")
    kinds = p.add_subparsers(dest="features", metavar="ACTION", required=True)
    q = kinds.add_parser(
        "import", help="import bottom-up features (TSV, self-critical.pytorch's npz, M2's HDF5)",
        description="Imports region features people already have into a features store of the prepared dataset: "
                    "sharded, keyed by image id, float16, with the boxes. Dataset images without features, "
                    "features of images the dataset does not have and malformed rows are reported, one line "
                    "each; a TSV cut short is an error naming the line. An interrupted import (killed, or a TSV cut "
                    "short and then completed) goes on from its last checkpoint when the same command runs "
                    "again; a rerun of a finished import is a no-op.",
        epilog="examples:\n"
               "  captioning features import --data-dir data/coco --tsv trainval_36/trainval_resnet101_faster_rcnn_"
               "genome_36.tsv --name bottomup\n"
               "  captioning features import --data-dir data/coco --npz-dir data/cocobu_att --boxes-dir "
               "data/cocobu_box --name bottomup\n"
               "  captioning features import --data-dir data/coco --hdf5 coco_detections.hdf5 --name bottomup",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--data-dir", required=True, help="the prepared dataset the features belong to")
    src = q.add_argument_group("source (exactly one)")
    src.add_argument("--tsv", metavar="FILE", help="bottom-up-attention's TSV: image_id, image_w, image_h, "
                                                   "num_boxes, boxes, features (base64 float32)")
    src.add_argument("--npz-dir", metavar="DIR", help="self-critical.pytorch's <id>.npz files (key feat)")
    src.add_argument("--boxes-dir", metavar="DIR", help="with --npz-dir: the <id>.npy boxes (x1, y1, x2, y2)")
    src.add_argument("--hdf5", metavar="FILE", help="the meshed-memory Transformer's HDF5 (<id>_features, <id>_boxes)")
    _shared(q)
    q.set_defaults(handler=run_import)

    q = kinds.add_parser(
        "extract", help="region features from a detector's boxes, pooled from a model's encoder grid",
        description="Pools a trained model folder's encoder grid inside each detected box (and the whole image) "
                    "with crop_and_resize (ROI align) and writes a features store of the prepared dataset. "
                    "Detections: COCO detection results files ([{image_id, bbox, score, category_id}], as "
                    "Detectron2, MMDetection and the TF Object Detection API write them) or COCO instances files "
                    "(score 1; on the synthetic data, oracle boxes). --shift, --miss and --false-boxes spoil the "
                    "boxes on purpose, to measure what box quality is worth.",
        epilog="example:\n"
               "  captioning features extract --data-dir runs/demo/scenes_records --images runs/demo/scenes/images \\\n"
               "      --model-dir runs/scenes_attention --detections runs/demo/scenes/annotations/instances_train.json \\\n"
               "      --detections runs/demo/scenes/annotations/instances_val.json --name oracle\n"
               "  captioning features extract --data-dir data/coco --images coco/ --config experiments/updown_coco.yaml \\\n"
               "      --detections detectron2_coco_results.json --name detectron2",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--data-dir", required=True, help="the prepared dataset the features belong to")
    q.add_argument("--images", required=True, metavar="DIR", dest="images_dir",
                   help="the original images (the boxes are in their pixels), found by the records' file names")
    q.add_argument("--model-dir", help="a trained model folder: its encoder's map is pooled, whichever decoder it trained")
    config_flags(q, required=False, help="or a config's encoder instead: model.encoder with model.encoder_weights "
                                         "(imagenet or a weights file) at data.image_size (no trained decoder needed)")
    boxes = q.add_mutually_exclusive_group(required=True)
    boxes.add_argument("--detections", action="append", metavar="FILE",
                       help="COCO detection results or instances file (repeatable)")
    boxes.add_argument("--grid-cells", type=within(1, MAX_GRID_CELLS), metavar="N",
                       help=f"no detector: N x N equal boxes tiling each image, N at most {MAX_GRID_CELLS} (the "
                            "baseline of the same encoder)")
    q.add_argument("--min-score", type=within(0, 1, float), default=0.2,
                   help="keep boxes scoring at least this, in [0, 1] as COCO results' scores (default 0.2)")
    q.add_argument("--max-boxes", type=within(1, MAX_BOXES), default=36,
                   help=f"the best this many boxes an image (default 36, at most {MAX_BOXES})")
    q.add_argument("--shift", type=within(0, 1, float), default=0.0,
                   help="jitter: move and scale boxes by up to this share, below 1 (default 0)")
    q.add_argument("--miss", type=within(0, 1, float), default=0.0,
                   help="jitter: drop each box with this probability (default 0)")
    q.add_argument("--false-boxes", type=within(0, MAX_FALSE_BOXES, float), default=0.0,
                   help=f"jitter: add this many random boxes an image on average (default 0, at most {MAX_FALSE_BOXES})")
    q.add_argument("--seed", type=within(0, MAX_SEED), default=0, help="jitter's seed (default 0)")
    _shared(q)
    q.set_defaults(handler=run_extract)


def run_extract(args) -> int:
    from captioning.data.prepared import PreparedDataset
    from captioning.errors import InputError
    from captioning.inference.captioner import load
    from captioning.inference.regions import (Jitter, detections_report, grid_boxes, read_detections,
                                              region_features)
    from data_prep.features_writer import Malformed, Row, check_sizes, finished_store, head_of, report, write_store

    jitter = Jitter(args.shift, args.miss, args.false_boxes, args.seed)  # every size checked before work starts
    check_sizes(args.images_per_shard, args.checkpoint_every)
    if bool(args.model_dir) == bool(args.config):
        raise InputError("give exactly one of --model-dir (a trained model's encoder) or --config (a config's)",
                         params=("model_dir", "config"))
    if args.config:  # a config's encoder, with the weights it names
        from captioning.experiment import load
        from captioning.model import build_encoder

        experiment = load(args.config, args.overrides)  # typed once: a key no chosen component reads is refused
        config, settings = experiment.config, experiment.encoder.settings
        if experiment.encoder.cls.random_weights(config.model, settings):
            raise InputError(f"--config: model.encoder {config.model.encoder} would pool regions from random weights "
                             "(model.encoder_weights: none): give model.encoder_weights (imagenet or a weights file), "
                             "a keras_hub preset, or a trained model with --model-dir", params=("config",))
        encoder = build_encoder(config.model, config.data.image_size, settings=settings)
        if encoder.layout is None:
            raise InputError(f"--config: model.encoder {config.model.encoder} declares no layout of its tokens, so "
                             "there is no map to pool regions from", params=("config",))
        source = {"kind": "extract", "encoder": encoder.describe()}
    else:
        trained = load(args.model_dir)
        encoder = trained.model.image_encoder  # its token set, whichever decoder trained (Show and Tell's too)
        if encoder.layout is None:
            raise InputError(f"--model-dir {args.model_dir}: its encoder ({trained.config.model.encoder}) declares no "
                             "layout of its tokens, so there is no map to pool regions from")
        source = {"kind": "extract", "model": os.path.abspath(args.model_dir), "checkpoint": trained.step}
    source.update({"min_score": args.min_score, "max_boxes": args.max_boxes, "jitter": dataclasses.asdict(jitter)})
    if args.grid_cells:
        source["grid_cells"] = args.grid_cells
    else:
        source["detections"] = [os.path.abspath(p) for p in args.detections]
    store = finished_store(args.data_dir, args.name, source, args.overwrite)
    written, matched = store is None, []
    if written:
        dataset = PreparedDataset.load(args.data_dir)
        if args.grid_cells:
            detections = {i: grid_boxes(r.width, r.height, args.grid_cells) for i, r in dataset.image_records().items()}
        else:
            detections = read_detections(args.detections, args.min_score, args.max_boxes)
            matched = detections_report(detections, dataset.image_records())

        def rows_from(skip):
            counts, unusable = {}, getattr(detections, "dropped", {})  # boxes clipped, dropped: for the report
            for i, r in region_features(encoder, dataset, args.images_dir, detections, jitter, skip=skip,
                                        box_counts=counts):
                if isinstance(r, str):
                    yield Malformed(f"image {i}", r)
                else:
                    clipped, dropped = counts.pop(i, (0, 0))
                    yield Row(i, r.features, r.boxes, r.width, r.height, clipped, dropped + unusable.get(i, 0))

        store = write_store(args.data_dir, rows_from, source=source, head=head_of(args.detections or []),
                            name=args.name, images_per_shard=args.images_per_shard, progress=not args.quiet,
                            what=f"--images {args.images_dir}", params=("images_dir",),
                            checkpoint_every=args.checkpoint_every, allow_missing=args.allow_missing)
    lines = report(store)
    if not written:
        lines[0] = lines[0].replace("features store", "features store (extracted already)", 1)
    print("\n".join(lines + matched))
    return 0


def run_import(args) -> int:
    from data_prep.features_import import import_features
    from data_prep.features_writer import report

    store, written = call(import_features, args, progress=not args.quiet)
    lines = report(store)
    if not written:
        lines[0] = lines[0].replace("features store", "features store (imported already)", 1)
    print("\n".join(lines))
    return 0
