"""``captioning synth``: writes a synthetic scenes dataset in COCO's layout.

Two kinds of scenes (``--scenes``), each a module of data_prep with a ``make_scene(rng)`` that draws
one image and returns ``(jpeg, width, height, captions, boxes)``, ``CATEGORIES`` (the kinds, COCO's
``categories``) and ``DESCRIPTION``:

- ``shapes`` (the default; data_prep/shapes.py): one to three shapes, three kinds, six colours, two sizes;
- ``hard`` (data_prep/scenes.py): three to six shapes that may overlap or sit inside each other, six
  kinds, eight colours, three sizes, three fills, clutter, and captions with counts, relations and the
  largest shape.

Output, laid out as COCO ships it::

    D/images/shapes_000001.jpg …
    D/annotations/captions_{train,val,test}.json   # info, licenses, images, annotations
    D/annotations/instances_{train,val,test}.json  # + categories; one box per shape
    D/annotations/dataset_shapes.json              # Karpathy's dataset_coco.json layout

The instances files are COCO's object-detection layout: the captions file's ``info``, ``licenses`` and
``images``, ``categories`` (the scene's kinds, ids from 1, supercategory ``shape``) and one annotation
per shape: ``id``, ``image_id``, ``category_id``, ``bbox`` ``[x, y, width, height]`` (the tight box of
the shape as drawn, in pixels of the stored image, to 1/100 px), ``area`` (the box's), ``iscrowd`` 0 and
``attributes`` ``{"color", "size"}``, with ``"fill"`` in the hard scenes
(:class:`captioning.data.scenes.ShapeBox`). ``info`` names the scenes (``"scenes": "hard"``; the shapes'
``info`` is unchanged from before there were two kinds).

Splits are 80/10/10 of a seeded shuffle. The same ``scenes``, ``seed`` and ``num_images`` give
byte-identical files (given the same Pillow/libjpeg build); ``--scenes shapes`` writes today's shapes
data byte for byte.

**Text only** (``--text-only``, :func:`synthesize_text`): the captions alone, for a language model to learn
from (``captioning lm train``)::

    D/captions.txt      # every caption of every image, one a line, image by image
    D/text_only.json    # scenes, seed, num_images, captions, sha256 of captions.txt: a rerun is a no-op

No pixel is drawn (each module's ``make_captions``: the scene is placed as for an image, then captioned), so it
is fast (100,000 hard scenes, 500,000 captions: docs/data.md has the time) and the captions are not those of the
image dataset of the same seed, but of the same distribution. Images are drawn in blocks of
:data:`TEXT_BLOCK`, block ``i`` from the seed ``[seed, i]``, in parallel processes: the same ``scenes``,
``seed`` and ``num_images`` give the same bytes on any machine, and a smaller ``num_images`` gives the first
lines of a larger one's file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent import futures

import numpy as np
from tqdm import tqdm

from captioning.data.scenes import SCENES
from captioning.errors import InputError
from captioning.fileio import atomic_file, atomic_write_bytes, atomic_write_json, make_dirs
from captioning.text import tokenize_caption
from data_prep import scenes as hard_scenes
from data_prep import shapes

MAKERS = {"shapes": shapes, "hard": hard_scenes}  # one entry per name in captioning.data.scenes.SCENES
SPLITS = ("train", "val", "test")
IMAGE_FILE = "shapes_{:06d}.jpg"
IMAGE_NAME = re.compile(r"shapes_(\d{6,})\.jpg")
TEXT_FILE, TEXT_RECORD = "captions.txt", "text_only.json"
TEXT_BLOCK = 2000  # images per block of --text-only (a block is one process's task)


def _split_counts(n: int) -> dict[str, int]:
    n_val = max(1, round(n * 0.1))
    n_test = max(1, round(n * 0.1))
    return {"train": n - n_val - n_test, "val": n_val, "test": n_test}


def _annotation(box, object_id: int, image_id: int, categories: list[dict]) -> dict:
    attributes = {"color": box.color, "size": box.size}
    if box.fill is not None:
        attributes["fill"] = box.fill
    bbox = list(box.bbox)
    category = next(c["id"] for c in categories if c["name"] == box.kind)
    return {"id": object_id, "image_id": image_id, "category_id": category, "bbox": bbox,
            "area": round(bbox[2] * bbox[3], 2), "iscrowd": 0, "attributes": attributes}


def synthesize(output_dir: str, num_images: int = 2000, seed: int = 0, overwrite: bool = False,
               progress: bool = True, scenes: str = "shapes") -> dict[str, int]:
    """Writes a synthetic dataset of ``scenes`` (``"shapes"`` or ``"hard"``) to ``output_dir`` (layout in
    the module docstring): the images, the COCO captions and instances files of each split and the
    Karpathy-style file.

    Returns the number of images per split. Refuses a non-empty ``output_dir`` unless ``overwrite``.
    """
    if scenes not in MAKERS:
        raise InputError(f"`scenes` must be one of {', '.join(SCENES)}, got {scenes!r}", params=("scenes",))
    maker = MAKERS[scenes]
    if num_images < 3:
        raise InputError(f"`num_images` must be at least 3 (one image per split), got {num_images}",
                         params=("num_images",))
    image_dir = os.path.join(output_dir, "images")
    ann_dir = os.path.join(output_dir, "annotations")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise InputError(f"{output_dir} is not empty; pass `overwrite=True` to write the {scenes} dataset there "
                         "anyway", params=("overwrite",))
    make_dirs(output_dir, "`output_dir`", ("output_dir",))
    make_dirs(image_dir, "`output_dir`: the images folder", ("output_dir",))
    make_dirs(ann_dir, "`output_dir`: the annotations folder", ("output_dir",))

    rng = np.random.default_rng(seed)
    counts = _split_counts(num_images)
    order = rng.permutation(num_images) + 1
    split_of = {}
    start = 0
    for split in SPLITS:
        for image_id in order[start:start + counts[split]]:
            split_of[int(image_id)] = split
        start += counts[split]

    coco = {s: {"images": [], "annotations": []} for s in SPLITS}
    objects = {s: [] for s in SPLITS}  # the instances files' annotations
    karpathy = []
    sentence_id = object_id = 0  # ids unique across the splits, as COCO's
    for image_id in tqdm(range(1, num_images + 1), desc="synth", unit="img",
                         disable=None if progress else True, mininterval=0.5):
        jpeg, w, h, captions, boxes = maker.make_scene(rng)
        file_name = IMAGE_FILE.format(image_id)
        atomic_write_bytes(os.path.join(image_dir, file_name), jpeg)
        split = split_of[image_id]
        coco[split]["images"].append({"id": image_id, "file_name": file_name, "width": w, "height": h,
                                      "license": 1})
        for box in boxes:
            object_id += 1
            objects[split].append(_annotation(box, object_id, image_id, maker.CATEGORIES))
        sentences = []
        for caption in captions:
            sentence_id += 1
            coco[split]["annotations"].append({"id": sentence_id, "image_id": image_id, "caption": caption})
            sentences.append({"raw": caption, "tokens": tokenize_caption(caption), "imgid": image_id - 1,
                              "sentid": sentence_id})
        karpathy.append({"filepath": "images", "filename": file_name, "imgid": image_id - 1, "cocoid": image_id,
                         "split": split, "sentids": [s["sentid"] for s in sentences], "sentences": sentences})

    info = {"description": maker.DESCRIPTION, "version": "1.0", "year": 2026, "contributor": "captioning synth",
            "url": "", "date_created": "2026-11-21", "seed": seed, "num_images": num_images}
    if scenes != SCENES[0]:
        info["scenes"] = scenes
    licenses = [{"id": 1, "name": "CC0 1.0 (synthetic)", "url": ""}]
    for split in SPLITS:
        atomic_write_json(os.path.join(ann_dir, f"captions_{split}.json"),
                          {"info": info, "licenses": licenses, **coco[split]}, indent=None)
        atomic_write_json(os.path.join(ann_dir, f"instances_{split}.json"),
                          {"info": info, "licenses": licenses, "images": coco[split]["images"],
                           "annotations": objects[split], "categories": maker.CATEGORIES}, indent=None)
    atomic_write_json(os.path.join(ann_dir, "dataset_shapes.json"), {"dataset": "shapes", "images": karpathy},
                      indent=None)
    # --overwrite with fewer images: images of an earlier, larger run would stay behind, unlisted
    for name in os.listdir(image_dir):
        match = IMAGE_NAME.fullmatch(name)
        if match and int(match.group(1)) > num_images:
            os.remove(os.path.join(image_dir, name))
    return counts


def load_split(output_dir: str, split: str) -> dict:
    """Reads one COCO annotations file back (for tests and summaries)."""
    with open(os.path.join(output_dir, "annotations", f"captions_{split}.json"), encoding="utf-8") as f:
        return json.load(f)


def _block_captions(scenes: str, seed: int, block: int, count: int) -> list[str]:
    """The captions of block ``block`` of ``--text-only``: ``count`` images from the seed ``[seed, block]``."""
    rng = np.random.default_rng([seed, block])
    maker = MAKERS[scenes]
    return [caption for _ in range(count) for caption in maker.make_captions(rng)]


def _text_record(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def synthesize_text(output_dir: str, num_images: int = 2000, seed: int = 0, overwrite: bool = False,
                    progress: bool = True, scenes: str = "shapes", workers: int | None = None) -> dict[str, int]:
    """Writes the captions of ``num_images`` synthetic images of ``scenes`` alone to ``output_dir/captions.txt``
    (module docstring, "Text only"), through a temporary name, and its record. A folder holding this very text
    already (same scenes, seed and images, the file's hash) is left as it is. Refuses a folder holding other
    files unless ``overwrite``. ``workers``: processes (default: the cores). Returns images and captions."""
    if scenes not in MAKERS:
        raise InputError(f"`scenes` must be one of {', '.join(SCENES)}, got {scenes!r}", params=("scenes",))
    if num_images < 1:
        raise InputError(f"`num_images` must be at least 1, got {num_images}", params=("num_images",))
    text, record_path = os.path.join(output_dir, TEXT_FILE), os.path.join(output_dir, TEXT_RECORD)
    wanted = {"scenes": scenes, "seed": seed, "num_images": num_images}
    record = _text_record(record_path)
    if record and {k: record.get(k) for k in wanted} == wanted and os.path.isfile(text) and \
            record.get("sha256") == _sha256(text):
        return {"images": num_images, "captions": record["captions"], "written": 0}
    others = [n for n in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
              if n not in (TEXT_FILE, TEXT_RECORD) and not n.startswith(TEXT_FILE + ".tmp")]
    if others and not overwrite:
        raise InputError(f"{output_dir} holds other files ({', '.join(sorted(others)[:3])}); pass `overwrite=True` "
                         "to write the captions there anyway", params=("overwrite",))
    make_dirs(output_dir, "`output_dir`", ("output_dir",))
    blocks = [(b, min(TEXT_BLOCK, num_images - b * TEXT_BLOCK)) for b in range(-(-num_images // TEXT_BLOCK))]
    workers = max(1, min(workers or os.cpu_count() or 1, len(blocks)))
    captions = 0
    with atomic_file(text, "w") as f, tqdm(total=num_images, desc="synth text", unit="img",
                                           disable=None if progress else True, mininterval=0.5) as bar:
        def write(lines, count):
            nonlocal captions
            f.write("".join(line + "\n" for line in lines))
            captions += len(lines)
            bar.update(count)

        if workers == 1:
            for b, count in blocks:
                write(_block_captions(scenes, seed, b, count), count)
        else:
            import multiprocessing

            with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                jobs = [pool.submit(_block_captions, scenes, seed, b, count) for b, count in blocks]
                for job, (_, count) in zip(jobs, blocks):
                    write(job.result(), count)
    atomic_write_json(record_path, {**wanted, "captions": captions, "sha256": _sha256(text)})
    return {"images": num_images, "captions": captions, "written": captions}
