"""The synthetic shapes dataset: exact COCO layout, determinism, and captions that match the pixels."""

import filecmp
import json
import os

import numpy as np
import pytest
from PIL import Image

from captioning.errors import InputError
from captioning.text import tokenize_caption
from data_prep.shapes import COLORS, KINDS, load_split, synthesize


def test_coco_layout_and_splits(shapes_dir):
    total_images = 0
    ids = set()
    for split, expected in [("train", 32), ("val", 4), ("test", 4)]:
        data = load_split(shapes_dir, split)
        assert set(data) == {"info", "licenses", "images", "annotations"}
        assert len(data["images"]) == expected
        for image in data["images"]:
            assert {"id", "file_name", "width", "height"} <= set(image)
            with Image.open(os.path.join(shapes_dir, "images", image["file_name"])) as im:
                assert im.format == "JPEG" and im.mode == "RGB"
                assert im.size == (image["width"], image["height"])
                assert 200 <= im.width <= 320 and 200 <= im.height <= 320
        by_image = {}
        for ann in data["annotations"]:
            assert set(ann) == {"id", "image_id", "caption"}
            by_image.setdefault(ann["image_id"], []).append(ann["caption"])
        assert set(by_image) == {im["id"] for im in data["images"]}
        for captions in by_image.values():
            assert len(captions) == 5 and len(set(captions)) == 5  # five different captions
        total_images += expected
        ids |= set(by_image)
    assert len(ids) == total_images == 40
    sizes = [(im["width"], im["height"]) for s in ("train", "val", "test") for im in load_split(shapes_dir, s)["images"]]
    assert sum(w != h for w, h in sizes) > 30  # not all square


def test_karpathy_file_matches_coco_files(shapes_dir):
    with open(os.path.join(shapes_dir, "annotations", "dataset_shapes.json"), encoding="utf-8") as f:
        karpathy = json.load(f)
    assert karpathy["dataset"] == "shapes" and len(karpathy["images"]) == 40
    coco = {s: load_split(shapes_dir, s) for s in ("train", "val", "test")}
    for image in karpathy["images"]:
        assert set(image) == {"filepath", "filename", "imgid", "cocoid", "split", "sentids", "sentences"}
        captions = [a["caption"] for a in coco[image["split"]]["annotations"] if a["image_id"] == image["cocoid"]]
        assert [s["raw"] for s in image["sentences"]] == captions
        assert all(s["tokens"] == tokenize_caption(s["raw"]) for s in image["sentences"])
        assert os.path.exists(os.path.join(shapes_dir, image["filepath"], image["filename"]))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    synthesize(a, num_images=12, seed=3, progress=False)
    synthesize(b, num_images=12, seed=3, progress=False)
    synthesize(c, num_images=12, seed=4, progress=False)
    for sub in ("images", "annotations"):
        names = sorted(os.listdir(os.path.join(a, sub)))
        assert names == sorted(os.listdir(os.path.join(b, sub)))
        match, mismatch, errors = filecmp.cmpfiles(os.path.join(a, sub), os.path.join(b, sub), names, shallow=False)
        assert mismatch == [] and errors == [] and len(match) == len(names)
    assert open(os.path.join(a, "annotations", "captions_train.json"), "rb").read() != \
        open(os.path.join(c, "annotations", "captions_train.json"), "rb").read()


def test_captions_describe_the_pixels(shapes_dir):
    """Every colour a caption names is drawn in the image, and no other shape colour is."""
    palette = np.array(list(COLORS.values()), dtype=np.float32)
    for split in ("train", "val", "test"):
        data = load_split(shapes_dir, split)
        for image in data["images"]:
            pixels = np.asarray(Image.open(os.path.join(shapes_dir, "images", image["file_name"])), np.float32)
            distance = np.linalg.norm(pixels[:, :, None, :] - palette[None, None], axis=-1)
            share = (distance < 45).mean(axis=(0, 1))  # fraction of pixels close to each shape colour
            drawn = {name for name, s in zip(COLORS, share) if s > 0.004}
            words = set()
            for ann in data["annotations"]:
                if ann["image_id"] == image["id"]:
                    words |= set(tokenize_caption(ann["caption"]))
            named = words & set(COLORS)
            assert named == drawn, (image["file_name"], named, drawn)
            assert words & set(KINDS)  # every image names at least one kind of shape


def test_counts_in_captions_agree(shapes_dir):
    data = load_split(shapes_dir, "train")
    for image in data["images"]:
        captions = [tokenize_caption(a["caption"]) for a in data["annotations"] if a["image_id"] == image["id"]]
        mentions = {sum(w in KINDS for w in c) for c in captions}
        assert len(mentions) == 1  # every caption names every shape
        (shapes,) = mentions
        counts = {w for c in captions for w in c if w in ("two", "three")}
        assert counts <= {{2: "two", 3: "three"}.get(shapes)}  # a count word, when used, is right


def test_refuses_non_empty_dir_and_tiny_sizes(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty; pass `overwrite=True`") as refused:
        synthesize(str(tmp_path), num_images=5, progress=False)
    assert refused.value.params == ("overwrite",)
    with pytest.raises(InputError, match="`num_images` must be at least 3") as refused:
        synthesize(str(tmp_path / "new"), num_images=2, progress=False)
    assert refused.value.params == ("num_images",)
