"""The synthetic shapes dataset: exact COCO layout, determinism, and captions that match the pixels."""

import filecmp
import json
import os

import numpy as np
import pytest
from PIL import Image

from captioning.errors import InputError
from captioning.text import tokenize_caption
from data_prep.shapes import COLORS, KINDS
from data_prep.synth import load_split, synthesize


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
    assert {f"instances_{s}.json" for s in ("train", "val", "test")} <= set(os.listdir(os.path.join(a, "annotations")))
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


def _instances(shapes_dir, split):
    with open(os.path.join(shapes_dir, "annotations", f"instances_{split}.json"), encoding="utf-8") as f:
        return json.load(f)


def test_instances_files_layout_and_boxes(shapes_dir):
    """Beside each captions file: the same info, licenses and images, the three kinds, a box per shape."""
    counts, ids = [], set()
    for split in ("train", "val", "test"):
        captions, instances = load_split(shapes_dir, split), _instances(shapes_dir, split)
        assert set(instances) == {"info", "licenses", "images", "annotations", "categories"}
        assert all(instances[k] == captions[k] for k in ("info", "licenses", "images"))
        assert instances["categories"] == [{"id": 1, "name": "circle", "supercategory": "shape"},
                                           {"id": 2, "name": "square", "supercategory": "shape"},
                                           {"id": 3, "name": "triangle", "supercategory": "shape"}]
        size = {im["id"]: (im["width"], im["height"]) for im in instances["images"]}
        per_image = {i: 0 for i in size}
        for ann in instances["annotations"]:
            assert set(ann) == {"id", "image_id", "category_id", "bbox", "area", "iscrowd", "attributes"}
            assert ann["category_id"] in (1, 2, 3) and ann["iscrowd"] == 0
            assert ann["attributes"]["color"] in COLORS and ann["attributes"]["size"] in ("small", "large")
            x, y, w, h = ann["bbox"]
            width, height = size[ann["image_id"]]
            assert 0 <= x < x + w <= width and 0 <= y < y + h <= height
            assert ann["area"] == pytest.approx(w * h, abs=0.01) and w * h > 0.04 * 200 * 200 * 0.24 ** 2
            per_image[ann["image_id"]] += 1
            ids.add(ann["id"])
        counts += per_image.values()
    assert set(counts) == {1, 2, 3}  # every image has 1-3 shapes, and each count occurs
    assert ids == set(range(1, sum(counts) + 1))  # ids unique across the splits


def test_captions_name_the_instances(shapes_dir):
    """Each caption names each annotated shape once: its colour right before its kind, and its size when
    it gives one."""
    size_of = {"small": "small", "little": "small", "tiny": "small", "large": "large", "big": "large"}
    for split in ("train", "val", "test"):
        instances = _instances(shapes_dir, split)
        shapes = {im["id"]: [] for im in instances["images"]}
        for ann in instances["annotations"]:
            shapes[ann["image_id"]].append((ann["attributes"]["color"], KINDS[ann["category_id"] - 1]))
            shapes[ann["image_id"]].sort()
        sizes = {}  # (image, colour, kind) -> sizes: two red circles differ in size
        for a in instances["annotations"]:
            sizes.setdefault((a["image_id"], a["attributes"]["color"], KINDS[a["category_id"] - 1]), set()).add(
                a["attributes"]["size"])
        for ann in load_split(shapes_dir, split)["annotations"]:
            words = tokenize_caption(ann["caption"])
            named = sorted((words[i - 1], w) for i, w in enumerate(words) if w in KINDS)
            assert named == shapes[ann["image_id"]], ann["caption"]
            for i, w in enumerate(words):
                if w in KINDS and i >= 2 and words[i - 2] in size_of:
                    assert size_of[words[i - 2]] in sizes[ann["image_id"], words[i - 1], w], ann["caption"]


def test_boxes_hold_the_shapes_pixels(shapes_dir):
    """Pixels of a shape's colour lie in the union of that image's boxes of that colour (a pixel's centre
    within 1.5 px of one: JPEG blurs edges); a colour drawn once fills its box out to each edge."""
    for split in ("train", "val", "test"):
        instances = _instances(shapes_dir, split)
        for image in instances["images"]:
            pixels = np.asarray(Image.open(os.path.join(shapes_dir, "images", image["file_name"])), np.float32)
            boxes = {}
            for ann in instances["annotations"]:
                if ann["image_id"] == image["id"]:
                    boxes.setdefault(ann["attributes"]["color"], []).append(ann["bbox"])
            for color, color_boxes in boxes.items():
                ys, xs = np.nonzero(np.linalg.norm(pixels - np.float32(COLORS[color]), axis=-1) < 45)
                cx, cy = xs + 0.5, ys + 0.5
                inside = np.zeros(len(xs), bool)
                for x, y, w, h in color_boxes:
                    inside |= (cx > x - 1.5) & (cx < x + w + 1.5) & (cy > y - 1.5) & (cy < y + h + 1.5)
                    in_box = (cx > x) & (cx < x + w) & (cy > y) & (cy < y + h)
                    assert in_box.sum() > 0.4 * w * h  # circles fill 79% of their box, triangles 50%
                assert inside.all(), (image["file_name"], color, int((~inside).sum()))
                if len(color_boxes) == 1:
                    (x, y, w, h), = color_boxes
                    extent = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
                    assert np.abs(extent - [x, y, x + w, y + h]).max() < 2.5, (image["file_name"], color)
