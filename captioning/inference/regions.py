"""Region features from any detector's boxes: a model's encoder map pooled inside each box (ROI align).

``captioning features extract`` (the command line writes the result as a features store,
:mod:`captioning.data.features_store`) reads:

- **detections**: COCO detection results files, ``[{"image_id", "bbox": [x, y, w, h], "score",
  "category_id"}, ...]`` — what Detectron2, MMDetection and the TF Object Detection API write — or COCO
  instances files (``{"annotations": [...]}``), whose boxes count as score 1: on the synthetic data the
  instances files are oracle boxes. Per image, the boxes scoring at least ``min_score``, the best
  ``max_boxes`` of them, in pixels of the original image;
- **images**: the original files (``images_dir`` / the record's file name), so the boxes' pixels are the
  detector's; each is squashed to the model's ``image_size`` square as the input pipeline does, and
  encoded by the model's encoder into its token set, whose map (``rows × cols × D``, as the encoder's layout
  declares it; a class token left out) is pooled. Whichever decoder the model trained — Show and Tell's
  pooled features too — the encoder's tokens are read.

Each box (and always the whole image, the last region) becomes one region: ``tf.image.crop_and_resize``
samples the grid at ``rows × cols`` points spread over the box (bilinear, as ROI align does), and their
mean is the region's feature. For the whole image that is exactly the mean of the grid's cells. Box
coordinates are normalised by the image's size; the grid's first and last cell centres stand for the
image's edges (crop_and_resize's convention).

**Grid cells as regions** (``grid_cells`` n instead of detections): n × n equal boxes tiling each image —
the regions of no detector, the baseline that detected boxes are measured against with the same encoder
and the same decoder.

**Jitter** makes oracle boxes imperfect, to measure how much box quality matters: each box is moved by
up to ``shift`` of its width and height and scaled by up to ``1 ± shift`` (clipped to the image), dropped
with probability ``miss``, and ``false_boxes`` random boxes per image are added on average (Poisson),
all drawn from ``seed`` and the image id, so the same settings give the same boxes.
"""

from __future__ import annotations

import collections
import json
import math
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.data.features_store import Regions, clean_boxes
from captioning.data.prepared import PreparedDataset
from captioning.data.reading import squash
from captioning.errors import InputError, excerpt
from captioning.images import ImageError, read_image_file


MAX_BOXES = 100  # boxes an image (max_boxes), as bottom-up features have 10-100
MAX_GRID_CELLS = 10  # grid_cells: 10 x 10 = 100 regions an image
MAX_FALSE_BOXES = 100  # false_boxes: random boxes an image, on average
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Jitter:
    """How oracle boxes are spoiled (module docstring); all zero: as given."""

    shift: float = 0.0
    miss: float = 0.0
    false_boxes: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (0 <= self.shift < 1 and 0 <= self.miss <= 1 and 0 <= self.false_boxes <= MAX_FALSE_BOXES
                and 0 <= self.seed <= MAX_SEED):
            raise InputError(f"jitter: `shift` must be in [0, 1), `miss` in [0, 1], `false_boxes` in [0, "
                             f"{MAX_FALSE_BOXES}] and `seed` in [0, {MAX_SEED}]; got {self.shift}, {self.miss}, "
                             f"{self.false_boxes}, {self.seed}", params=("shift", "miss", "false_boxes", "seed"))

    def apply(self, boxes: np.ndarray, image_id: int, width: int, height: int) -> np.ndarray:
        """``boxes [n, 4]`` (x, y, w, h pixels) spoiled for ``image_id``."""
        if not (self.shift or self.miss or self.false_boxes):
            return boxes
        rng = np.random.default_rng([self.seed, image_id])
        x, y, w, h = boxes.T.astype(np.float64)
        move = rng.uniform(-self.shift, self.shift, (4, len(boxes)))
        w2, h2 = w * (1 + move[2]), h * (1 + move[3])
        x2, y2 = x + move[0] * w + (w - w2) / 2, y + move[1] * h + (h - h2) / 2
        kept = np.stack([x2, y2, w2, h2], axis=1)[rng.random(len(boxes)) >= self.miss]
        extra = rng.poisson(self.false_boxes)
        size = rng.uniform(0.1, 0.4, (extra, 2)) * [width, height]
        corner = rng.uniform(0, 1, (extra, 2)) * ([width, height] - size)
        out = np.concatenate([kept, np.concatenate([corner, size], axis=1)]) if extra else kept
        x0, y0 = np.clip(out[:, 0], 0, width), np.clip(out[:, 1], 0, height)
        x1, y1 = np.clip(out[:, 0] + out[:, 2], 0, width), np.clip(out[:, 1] + out[:, 3], 0, height)
        out = np.stack([x0, y0, x1 - x0, y1 - y0], axis=1)
        return out[(out[:, 2] > 1) & (out[:, 3] > 1)].astype(np.float32)


class Detections(dict):
    """Image id → its boxes ``[n, 4]`` (x, y, w, h pixels), best first; ``dropped``: per image id, how many
    boxes scoring at least the threshold were dropped for not being boxes at all (a coordinate not finite,
    no width or no height: :func:`~captioning.data.features_store.clean_boxes`' rule, before the image's
    size is known; clipping to the image comes when it is)."""

    def __init__(self, boxes=(), dropped=None):
        super().__init__(boxes)
        self.dropped: dict[int, int] = dict(dropped or {})


def read_detections(paths: Sequence[str], min_score: float = 0.2, max_boxes: int = 36) -> Detections:
    """Each image's boxes ``[n, 4]`` (x, y, w, h pixels), best first, from COCO detection results files or
    instances files (score 1); at most ``max_boxes`` of those scoring at least ``min_score``. A file with no
    detection at all, or detections none of which scores ``min_score``, is an InputError."""
    if not 1 <= max_boxes <= MAX_BOXES:
        raise InputError(f"`max_boxes` must be an integer in [1, {MAX_BOXES}], got {max_boxes}", params=("max_boxes",))
    if not math.isfinite(min_score):
        raise InputError(f"`min_score` must be a finite number, got {min_score}", params=("min_score",))
    found: dict[int, list] = collections.defaultdict(list)
    dropped: dict[int, int] = collections.Counter()
    rows_read = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise InputError(f"`detections` {path}: cannot read it ({e.strerror or e})", params=("detections",)) \
                from None
        except ValueError as e:
            raise InputError(f"`detections` {path} is not JSON ({e})", params=("detections",)) from None
        rows = data.get("annotations") if isinstance(data, dict) else data
        try:
            if isinstance(rows, list) and not rows:
                raise InputError(f"`detections` {path} holds no detection ({excerpt(rows, 40)}): give the "
                                 "detector's results for the images", params=("detections",))
            for row in rows:
                x, y, w, h = (float(v) for v in row["bbox"])
                score = float(row.get("score", 1.0)) if isinstance(data, list) else 1.0
                image_id = int(row["image_id"])
                rows_read += 1
                if score >= min_score:
                    if clean_boxes([[x, y, x + w, y + h]], math.inf, math.inf).dropped:
                        dropped[image_id] += 1
                    else:
                        found[image_id].append((score, x, y, w, h))
        except (TypeError, KeyError, ValueError) as e:
            raise InputError(f"`detections` {path} is neither COCO detection results ([{{image_id, bbox, score}}]) "
                             f"nor a COCO instances file ({type(e).__name__}: {e})", params=("detections",)) from None
    if not found and not dropped:
        raise InputError(f"none of the {rows_read} detections of `detections` {', '.join(paths)} scores at least "
                         f"`min_score` {min_score:g}", params=("detections", "min_score"))
    return Detections({image_id: np.array([b[1:] for b in sorted(boxes, key=lambda b: -b[0])[:max_boxes]],
                                          np.float32) for image_id, boxes in found.items()}, dropped)


def encoder_of(model):
    """The :class:`~captioning.model.encoders.base.ImageEncoder` regions are pooled with: a captioning model's
    (whichever decoder it trained: its encoder's token set, of the same weights), or an encoder itself."""
    return getattr(model, "image_encoder", model)


def token_maps(encoder, images) -> tf.Tensor:
    """Pixels ``[B, S, S, 3]`` → the encoder's map ``[B, rows, cols, D]`` (float32; its prefix tokens, such as a
    ViT's class token, left out: they have no place to pool). An InputError for an encoder without a layout."""
    layout = encoder.layout
    if layout is None:
        raise InputError(f"model.encoder {encoder.name} declares no layout of its tokens: there is no map to pool "
                         "regions from", params=("model_dir",))
    rows = tf.shape(images)[0]  # an empty batch runs one row of zeros (convolutions mis-shape none), cut away
    images = tf.pad(images, [[0, tf.maximum(1 - rows, 0)], [0, 0], [0, 0], [0, 0]])
    tokens = tf.cast(encoder.tokens_model()(images, training=False), tf.float32)[:rows, layout.prefix:]
    return tf.reshape(tokens, [rows, layout.rows, layout.cols, tokens.shape[-1]])


def grid_boxes(width: int, height: int, cells: int) -> np.ndarray:
    """``cells × cells`` equal boxes tiling a ``width × height`` image, row by row, as ``[x, y, w, h]`` pixels
    (``cells`` at most :data:`MAX_GRID_CELLS`).

    >>> grid_boxes(100, 50, 2).tolist()
    [[0.0, 0.0, 50.0, 25.0], [50.0, 0.0, 50.0, 25.0], [0.0, 25.0, 50.0, 25.0], [50.0, 25.0, 50.0, 25.0]]
    """
    if not 1 <= cells <= MAX_GRID_CELLS:
        raise InputError(f"`grid_cells` must be an integer in [1, {MAX_GRID_CELLS}], got {cells}",
                         params=("grid_cells",))
    w, h = width / cells, height / cells
    return np.array([[c * w, r * h, w, h] for r in range(cells) for c in range(cells)], np.float32)


def pool_regions(grid: tf.Tensor, boxes: tf.Tensor) -> tf.Tensor:
    """``grid [rows, cols, D]`` and normalised ``boxes [n, 4]`` (y1, x1, y2, x2) → ``[n, D]``: the mean of
    ``rows × cols`` bilinear samples spread over each box.

    >>> grid = tf.reshape(tf.range(16, dtype=tf.float32), [4, 4, 1])
    >>> pool_regions(grid, tf.constant([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])).numpy().ravel().tolist()
    [7.5, 0.0]
    """
    return pool_batch(grid[None], boxes[None])[0]


def pool_batch(grids: tf.Tensor, boxes: tf.Tensor) -> tf.Tensor:
    """:func:`pool_regions` for a batch: ``grids [B, rows, cols, D]``, ``boxes [B, N, 4]`` → ``[B, N, D]``."""
    rows, cols = grids.shape[1], grids.shape[2]
    batch, n = tf.shape(boxes)[0], tf.shape(boxes)[1]
    owner = tf.repeat(tf.range(batch), n)
    crops = tf.image.crop_and_resize(grids, tf.reshape(boxes, [-1, 4]), owner, [rows, cols])
    return tf.reshape(tf.reduce_mean(crops, axis=[1, 2]), [batch, n, grids.shape[-1]])


def boxes_to_regions(model, images: tf.Tensor, boxes: tf.Tensor, sizes: tf.Tensor) -> dict:
    """A model's input for new images: ``images [B, S, S, 3]`` (the whole images squashed to the model's
    ``image_size``), their ``boxes [B, N, 4]`` (x, y, width, height in pixels of the original images, as COCO
    detection results give them; a box of no width or height is padding) and ``sizes [B, 2]`` (height,
    width) → ``{"regions", "boxes", "region_mask"}`` as the features store gives them: each box pooled from
    the encoder's grid, the whole image last, float16, boxes as fractions of the image."""
    grids = token_maps(encoder_of(model), images)
    boxes = tf.cast(boxes, tf.float32)
    height, width = (tf.cast(sizes[:, i], tf.float32)[:, None] for i in (0, 1))
    x1, y1 = boxes[..., 0] / width, boxes[..., 1] / height
    x2, y2 = (boxes[..., 0] + boxes[..., 2]) / width, (boxes[..., 1] + boxes[..., 3]) / height
    corners = tf.clip_by_value(tf.stack([x1, y1, x2, y2], axis=-1), 0.0, 1.0)
    real = tf.cast((boxes[..., 2] > 0) & (boxes[..., 3] > 0), tf.float32)
    whole = tf.tile(tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), [tf.shape(boxes)[0], 1, 1])
    corners = tf.concat([corners * real[..., None], whole], axis=1)  # the whole image last, as extraction does
    mask = tf.concat([real, tf.ones_like(real[:, :1])], axis=1)
    pooled = pool_batch(grids, tf.gather(corners, [1, 0, 3, 2], axis=-1))  # crop_and_resize wants y1, x1, y2, x2
    regions = tf.cast(pooled * mask[..., None], tf.float16)  # the store keeps float16
    return {"regions": regions, "boxes": corners, "region_mask": mask}


def region_features(model, dataset: PreparedDataset, images_dir: str, detections: dict[int, np.ndarray],
                    jitter: Jitter = Jitter(), batch_size: int = 32, skip: int = 0, box_counts: dict | None = None
                    ) -> Iterator[tuple[int, Regions | str]]:
    """``(image id, Regions)`` for every image of ``dataset`` (all splits, by id), its detected boxes and the
    whole image pooled from ``model``'s encoder grid (module docstring); ``(image id, reason)`` for an image
    whose file cannot be read. One a record, in the order of the ids, after the first ``skip`` (a resumed
    extraction). The images are read, decoded and squashed in a parallel ``tf.data`` map while the encoder
    runs. The boxes (after jitter) follow :func:`~captioning.data.features_store.clean_boxes` in the image's
    pixels: clipped to it, degenerate ones dropped; ``box_counts[image_id]`` gets ``(clipped, dropped)``."""
    encoder = encoder_of(model)
    size = encoder.image_size
    encode = tf.function(lambda images: token_maps(encoder, images), reduce_retracing=True, autograph=False)

    def regions_of(ids, pixels, widths, heights):  # one encoder call and one pooling call for the batch
        grids = encode(pixels)
        corners, normal = [], []
        for image_id, width, height in zip(ids, widths, heights):
            boxes = jitter.apply(detections.get(image_id, np.zeros((0, 4), np.float32)), image_id, width, height)
            clean = clean_boxes(np.stack([boxes[:, 0], boxes[:, 1], boxes[:, 0] + boxes[:, 2],
                                          boxes[:, 1] + boxes[:, 3]], 1), width, height)
            if box_counts is not None:
                box_counts[image_id] = (clean.clipped, clean.dropped)
            corners.append(np.concatenate([clean.boxes, [[0, 0, width, height]]]).astype(np.float32))  # + the whole
            normal.append(corners[-1][:, [1, 0, 3, 2]] / np.array([height, width, height, width], np.float32))
        padded = np.zeros((len(ids), max(len(n) for n in normal), 4), np.float32)
        for i, n in enumerate(normal):
            padded[i, :len(n)] = n
        pooled = pool_batch(grids, tf.constant(padded)).numpy()
        for i, (image_id, width, height) in enumerate(zip(ids, widths, heights)):
            yield image_id, Regions(pooled[i, :len(normal[i])], corners[i], width, height)

    @do_not_convert
    def load(image_id, path):  # in the input pipeline: parallel, no Python per image
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        shape = tf.shape(image)
        return image_id, squash(image, size), shape[1], shape[0]

    def unreadable(image_id, file_name):  # why (the pipeline only left it out)
        try:
            tf.io.decode_image(read_image_file(os.path.join(images_dir, file_name)), channels=3,
                               expand_animations=False)
            reason = "cannot be read"
        except (ImageError, OSError, tf.errors.InvalidArgumentError) as e:
            reason = str(e)
        return image_id, f"{file_name}: {reason}"

    records = sorted(dataset.image_records().items())[skip:]
    if not records:
        return
    images = tf.data.Dataset.from_tensor_slices(([i for i, _ in records],
                                                 [os.path.join(images_dir, r.file_name) for _, r in records]))
    # an image that cannot be read or decoded is left out here, and found missing in the order of the ids
    images = images.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
    position = 0  # the next record to yield
    for ids, pixels, widths, heights in images.batch(batch_size).prefetch(2):
        ids, widths, heights = (x.numpy().tolist() for x in (ids, widths, heights))
        for image_id, regions in regions_of(ids, pixels, widths, heights):
            while records[position][0] != image_id:
                yield unreadable(records[position][0], records[position][1].file_name)
                position += 1
            yield image_id, regions
            position += 1
    for image_id, record in records[position:]:
        yield unreadable(image_id, record.file_name)


def detections_report(detections: dict[int, np.ndarray], image_ids) -> list[str]:
    """Lines on how detections match a dataset's images: images without a box (only the whole image is
    pooled for them) and detections of images the dataset does not have; an InputError when they match
    none of its images.

    >>> boxes = np.ones((1, 4), np.float32)
    >>> detections_report({1: boxes, 7: boxes}, [1, 2, 3])
    ['detections: 2 images without a box (their whole image only; e.g. 2, 3)', 'detections: 1 images not in the dataset (e.g. 7)']
    """
    ids = set(int(i) for i in image_ids)
    without = sorted(ids - set(detections))
    unknown = sorted(set(detections) - ids)
    if not ids & set(detections):
        if unknown:
            raise InputError(f"`detections` name none of the dataset's {len(ids)} images (e.g. image "
                             f"{unknown[0]}): are they of another dataset?", params=("detections",))
        dropped = sum(getattr(detections, "dropped", {}).values())
        raise InputError(f"`detections` give no usable box for any of the dataset's {len(ids)} images ({dropped} "
                         "dropped: a coordinate not finite, no width or no height)", params=("detections",))
    lines = []
    if without:
        lines.append(f"detections: {len(without)} images without a box (their whole image only; e.g. "
                     f"{', '.join(map(str, without[:5]))})")
    if unknown:
        lines.append(f"detections: {len(unknown)} images not in the dataset (e.g. {', '.join(map(str, unknown[:5]))})")
    return lines
