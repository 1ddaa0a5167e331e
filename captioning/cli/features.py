"""``captioning features import``: the flags; the work is in :mod:`data_prep.features_import` (a features store
beside a prepared dataset, :mod:`captioning.data.features_store`)."""

from __future__ import annotations

import argparse

from captioning.cli.parsing import POSITIVE, call


def add_features(sub) -> None:
    p = sub.add_parser("features", help="region features beside a prepared dataset (import)",
                       description="Region features for a prepared dataset, kept in a features store inside it "
                                   "(DATA/features/NAME/).")
    kinds = p.add_subparsers(dest="features", metavar="ACTION", required=True)
    q = kinds.add_parser(
        "import", help="import bottom-up features (TSV, self-critical.pytorch's npz, M2's HDF5)",
        description="Imports region features people already have into a features store of the prepared dataset: "
                    "sharded, keyed by image id, float16, with the boxes. Dataset images without features, "
                    "features of images the dataset does not have and malformed rows are reported, one line "
                    "each; a TSV cut short is an error naming the line. A rerun of a finished import is a no-op.",
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
    q.add_argument("--name", default="regions", help="the store's name, a folder in DATA/features/ (default regions)")
    q.add_argument("--images-per-shard", type=POSITIVE, default=1000,
                   help="images per shard (default 1000: ~150 MB of 36 regions × 2,048 float16 features)")
    q.add_argument("--overwrite", action="store_true", help="replace a store of this name from another source")
    q.set_defaults(handler=run_import)


def run_import(args) -> int:
    from data_prep.features_import import import_features, report

    store, written = call(import_features, args, progress=not args.quiet)
    lines = report(store)
    if not written:
        lines[0] = lines[0].replace("features store", "features store (imported already)", 1)
    print("\n".join(lines))
    return 0
