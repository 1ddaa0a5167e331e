"""``captioning caption``: captions for your own images.

Paths may be image files (any format Pillow reads: JPEG, PNG, GIF, WebP, BMP, TIFF, …) or folders, whose
files with an image extension are taken in name order. Each file is opened and checked on its own: a
file that is not an image, is empty or is corrupt gets one error line and the others are still
captioned; the command then exits with code 1. JPEG and PNG bytes go to the model as they are; other
formats, EXIF-rotated and huge images (longer side > 4096 px) are first converted to PNG (lossless), so
the model sees exactly what ``tf.io`` decodes in the exported SavedModel.

Huge images are downscaled, not refused: Pillow's decompression-bomb limit (about 89M pixels, which
``prepare`` keeps) does not apply here. A JPEG is decoded with libjpeg's DCT scaling (``Image.draft``) at
1/2, 1/4 or 1/8 size, whichever is the smallest still at least 4096 px on its longer side, so a
20000 × 10000 photo is decoded at 5000 × 2500 and never at full size. Other formats have no reduced
decode; they are decoded whole as long as that takes at most ``MAX_DECODE_BYTES`` (1 GiB, counted as 4
bytes a pixel: up to 2^28 pixels, e.g. 16384 × 16384), and refused with "image too large: decoding WxH
pixels would need about N GiB" beyond. The same budget counts the coefficients a progressive JPEG keeps
at full size (6 bytes a pixel for colour), so progressive JPEGs beyond about 170M pixels are refused too.
The budget bounds what one file can cost on a shared machine; ``captioning.images`` explains the estimate.

A model reading **regions** (``data.features: regions``) takes each image's boxes: ``--detections FILE``
(repeatable), COCO detection results (``[{"image_id", "bbox", "score"}]``, what Detectron2, MMDetection
and the TF Object Detection API write; boxes scoring at least 0.2, the best 36 an image) or COCO instances
files (an empty one is refused). An image file is matched to its detections by an instances file's
``images`` list (its ``file_name``), or else by the number its name ends with
(``COCO_val2014_000000000042.jpg`` and ``42.png`` are image 42); an image without detections is read as
its whole image alone, and named in a warning line. Boxes follow the one rule of
:func:`captioning.data.features_store.clean_boxes` (clipped to the image, degenerate ones dropped), and
what was dropped or clipped is counted in a warning line. Its regions are pooled from
the model's encoder as ``captioning features extract`` pooled those it was trained on. The gallery then
shows, per word, the region the model attended to most, outlined on the image (its picture's ``data-region``
attribute is that region's index in ``--json``'s ``regions``), and ``--json`` gives ``regions`` (each region's
x1, y1, x2, y2 as fractions of the image, the whole image last) and per word its weights over them.

``--html`` writes a self-contained gallery page: thumbnails are embedded as data URIs and every caption
and file name is HTML-escaped. For an attention decoder each image's best caption comes with one small
picture per word: the crop the model saw, lit where it looked while choosing that word
(:mod:`captioning.model.pictures`). ``--json`` then also gives, per caption, ``attention``: for each word
its weights over the encoder's tokens in their order, and the image's ``grid`` (rows and columns) with
``prefix_tokens``: the tokens before the map (a ViT's class token), which the pictures show apart as a bar
along their foot. An encoder that declares no layout gives ``tokens`` (how many) instead, and its pictures
are a bar per token.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import os
import re
import sys
from dataclasses import dataclass

import numpy as np
from PIL import Image

from captioning.data.features_store import clean_boxes
from captioning.errors import InputError
from captioning.fileio import atomic_write_bytes
from captioning.images import ImageError, process_image, read_image_file
from captioning.model.pictures import outlined, spotlight

log = logging.getLogger("captioning.caption")

MAX_SIDE = 4096
MAX_DECODE_BYTES = 1 << 30  # memory one image's decode may take (see the module docstring)
BATCH = 16


@dataclass
class Result:
    path: str
    captions: list | None = None  # captioning.inference.captioner.Caption: unpacks as (text, log_prob)
    error: str | None = None
    data: bytes | None = None  # the bytes the model saw, for the gallery's thumbnail
    attends: bool = False  # the captions come with attention weights (an attention decoder)
    layout: object = None  # where the encoder's tokens sit (captioning.model.layout.TokenLayout), or None
    boxes: object = None  # a model reading regions: the image's detected boxes [n, 4] (x, y, width, height)
    boxes_dropped: int = 0  # of them, dropped (not finite, no area inside the image) and clipped to the image
    boxes_clipped: int = 0
    attention_absent: str | None = None  # why a language-model decoder's captions carry no attention (the record says)

    def captioned(self, captions: list | None, error: str | None, layout, attention_absent: str | None = None) -> None:
        """Takes the image's ``captions`` (or the ``error`` that kept it from any) and, when they carry attention
        weights, ``layout``: where the encoder's tokens sit (the captioner's; None over regions);
        ``attention_absent``: the captioner's :attr:`~captioning.inference.captioner.Captioner.attention_absent`."""
        self.captions, self.error = captions, error
        self.attends = bool(captions and captions[0].attention is not None)
        self.layout = layout if self.attends else None
        self.attention_absent = None if self.attends else attention_absent


def collect_paths(paths: list[str]) -> list[str]:
    """Files as given, and the image files of folders (sorted by name). A path that does not exist stays
    in the list (it gets its own error line, like any unreadable file); only when nothing at all is
    left to try — no given path exists, or folders without image files — is it an InputError."""
    extensions = {ext.lower() for ext in Image.registered_extensions()}
    files = []
    for path in paths:
        if os.path.isdir(path):
            inside = sorted(os.path.join(path, n) for n in os.listdir(path))
            files += [p for p in inside if os.path.isfile(p) and os.path.splitext(p)[1].lower() in extensions]
        else:
            files.append(path)
    if not any(os.path.exists(p) for p in paths):
        raise InputError(f"{paths[0]} does not exist" if len(paths) == 1 else
                         f"none of the {len(paths)} paths exists (e.g. {paths[0]})")
    if not files:
        raise InputError(f"no image files in {', '.join(paths)}")
    return files


def read_for_model(path: str) -> bytes:
    """The bytes to give the model for ``path``: JPEG/PNG kept, anything else converted to PNG."""
    try:
        data = read_image_file(path)
    except ImageError as e:
        raise ImageError("does not exist" if str(e) == "missing file" else str(e)) from None
    return model_bytes(data)


def model_bytes(data: bytes) -> bytes:
    """The bytes to give the model for an image file's bytes ``data`` (the module docstring: JPEG/PNG kept, anything
    else converted to PNG, huge images downscaled); :class:`ImageError` when they are not a usable image.
    ``captioning serve`` reads its uploads with it, as ``caption`` reads files."""
    encoded, _, _ = process_image(data, keep=("JPEG", "PNG"), output="PNG", max_side=MAX_SIDE,
                                  max_decode_bytes=MAX_DECODE_BYTES)
    return encoded


class BoxesPerFile(list):
    """Each file's boxes, and (``unusable``) how many of each file's detections were not boxes at all (a
    coordinate not finite, no width or no height: dropped by :func:`read_detections`)."""

    def __init__(self, boxes, unusable):
        super().__init__(boxes)
        self.unusable = list(unusable)


def detections_for(paths: list[str], detections: list[str]) -> BoxesPerFile:
    """Each image file's boxes ``[n, 4]`` (x, y, width, height) from COCO detection results or instances files
    (module docstring: matched by an instances file's ``file_name``, else by the number a file name ends with).
    An empty detections file is an InputError."""
    import numpy as np

    from captioning.inference.regions import read_detections

    found = read_detections(detections)
    ids = {}
    for path in detections:  # the images lists of instances files: file name -> id
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for image in data.get("images", []) if isinstance(data, dict) else []:
            if isinstance(image, dict) and "file_name" in image and "id" in image:
                ids[os.path.basename(str(image["file_name"]))] = int(image["id"])
    out, unusable = [], []
    for path in paths:
        name = os.path.basename(path)
        number = re.search(r"(\d+)$", os.path.splitext(name)[0])
        image_id = ids.get(name, int(number.group(1)) if number else None)
        out.append(found.get(image_id, np.zeros((0, 4), np.float32)))
        unusable.append(found.dropped.get(image_id, 0))
    return BoxesPerFile(out, unusable)


def clean_file_boxes(result: Result, unusable: int = 0) -> None:
    """``result``'s boxes (x, y, width, height pixels) by the one rule for boxes
    (:func:`captioning.data.features_store.clean_boxes`) in the pixels of the image the model is given:
    clipped to it, degenerate ones dropped, both counted on ``result``."""
    with Image.open(io.BytesIO(result.data)) as image:
        width, height = image.size
    x, y, w, h = np.asarray(result.boxes, np.float32).reshape(-1, 4).T
    clean = clean_boxes(np.stack([x, y, x + w, y + h], 1), width, height)
    x1, y1, x2, y2 = clean.boxes.T
    result.boxes = np.stack([x1, y1, x2 - x1, y2 - y1], 1).astype(np.float32)
    result.boxes_dropped, result.boxes_clipped = clean.dropped + unusable, clean.clipped


def boxes_report(results: list[Result]) -> list[str]:
    """One line each: the images (read) that have no box, so are captioned from their whole image alone;
    the boxes dropped; the boxes clipped.

    >>> r = [Result("a.jpg", boxes=np.zeros((0, 4))), Result("b.jpg", boxes=np.ones((2, 4)), boxes_dropped=1)]
    >>> boxes_report(r)
    ['detections: 1 of 2 images have no box, each captioned from its whole image alone: a.jpg', 'detections: 1 boxes dropped (a coordinate not finite, or no area inside the image; e.g. b.jpg: 1)']
    """
    read = [r for r in results if r.error is None and r.boxes is not None]
    lines = []
    without = [r.path for r in read if not len(r.boxes)]
    if without:
        lines.append(f"detections: {len(without)} of {len(read)} images have no box, each captioned from its whole "
                     f"image alone: {', '.join(without[:5])}" + (", ..." if len(without) > 5 else ""))
    for kind, what in (("boxes_dropped", "dropped (a coordinate not finite, or no area inside the image; e.g."),
                       ("boxes_clipped", "clipped to the image (e.g.")):
        hit = [(r.path, getattr(r, kind)) for r in read if getattr(r, kind)]
        if hit:
            examples = "; ".join(f"{path}: {n}" for path, n in hit[:3])
            lines.append(f"detections: {sum(n for _, n in hit)} boxes {what} {examples})")
    return lines


def caption_each(call, items: list, image_errors: tuple | None = None) -> list[tuple[list | None, str | None]]:
    """Per item, ``(captions, None)`` or ``(None, error)``: ``call(items)`` (a list of captions per item) once,
    and when that call fails with an image's error (an image TensorFlow cannot decode must not sink the others)
    each item alone, a failing one getting its one-line error. ``image_errors``: the exception types that are an
    image's fault (default: TensorFlow's ``InvalidArgumentError``, what its decoders raise); any other (out of
    memory, a fault of the model) is raised as it is, never reported as an image's. ``caption`` runs its batches
    of files so, ``captioning serve`` its model calls.

    >>> def call(items):
    ...     if "bad" in items:
    ...         raise ValueError("not a JPEG\\nmore")
    ...     return [[item.upper()] for item in items]
    >>> caption_each(call, ["a", "bad"], image_errors=(ValueError,))
    [(['A'], None), (None, 'cannot decode: not a JPEG')]
    """
    if image_errors is None:
        import tensorflow as tf

        image_errors = (tf.errors.InvalidArgumentError,)
    try:
        return [(captions, None) for captions in call(items)]
    except image_errors:
        out = []
        for item in items:
            try:
                out.append((call([item])[0], None))
            except image_errors as e:  # TensorFlow's decode errors
                out.append((None, f"cannot decode: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"))
        return out


def caption_files(captioner, paths: list[str], progress: bool = True, boxes: list | None = None) -> list[Result]:
    """Captions of every file (one error per unreadable file); ``boxes`` per file for a model reading regions."""
    from tqdm import tqdm

    results = [Result(p, boxes=boxes[i] if boxes is not None else None) for i, p in enumerate(paths)]
    ready = []
    for i, result in enumerate(results):
        try:
            result.data = read_for_model(result.path)
            if boxes is not None:
                clean_file_boxes(result, getattr(boxes, "unusable", [0] * len(paths))[i])
            ready.append(result)
        except ImageError as e:
            result.error = str(e)
    for line in boxes_report(results) if boxes is not None else []:
        log.warning("%s", line)
    for start in tqdm(range(0, len(ready), BATCH), desc="caption", unit="batch", disable=None if progress else True):
        batch = ready[start:start + BATCH]
        done = caption_each(lambda rs: captioner.caption([r.data for r in rs], [r.boxes for r in rs] if boxes else None),
                            batch)
        for r, (c, error) in zip(batch, done):
            r.captioned(c, error, captioner.token_layout, captioner.attention_absent)
    from captioning.model.decode import empty_captions_warning

    warning = empty_captions_warning([r.captions[0].text for r in results if r.captions])
    if warning:  # never silent (decoding gives every caption a word: an old export, a changed decoder)
        log.warning("%s", warning)
    return results


def _png(pixels) -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def word_pictures(result: Result, tile: int = 72) -> list[tuple[str, str, int | None]]:
    """The best caption's words of an attending decoder, each with its picture (see the module docstring) as a PNG
    data URI and, over regions, the index of the region outlined on it (in ``--json``'s ``regions``; else None):
    what the gallery shows and ``captioning serve`` returns."""
    best = result.captions[0]
    words = best.text.split()
    if best.boxes is not None:  # regions: the one attended to most, outlined
        chosen = [int(np.argmax(w)) for w in best.attention]
        pictures = [outlined(best.image, best.boxes[k], tile) for k in chosen]
    else:
        chosen = [None] * len(best.attention)
        pictures = [spotlight(best.image, w, result.layout, tile) for w in best.attention]
    return [(word, _png(picture), k) for word, picture, k in zip(words, pictures, chosen)]


def _attention_row(result: Result, tile: int = 72) -> str:
    """The best caption's words, each under its picture (:func:`word_pictures`); over regions, each
    picture's ``data-region`` is the index of the region outlined on it (in ``--json``'s ``regions``)."""
    tiles = "".join(f'<span class="word"><img src="{src}" alt="attention for {html.escape(word)}"'
                    + ("" if k is None else f' data-region="{k}"') + f'><br>{html.escape(word)}</span>'
                    for word, src, k in word_pictures(result, tile))
    return f'<div class="attention">{tiles}</div>'


def _thumbnail(data: bytes, size: int = 256) -> str:
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        image.thumbnail((size, size))
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def _attention_legend(results: list[Result]) -> str:
    """What the per-word pictures of ``results`` show: a map lit where the model looked (prefix tokens apart), a
    bar per token, or the region it attended to most outlined."""
    shown = [r for r in results if not r.error and r.attends]
    over_regions = [getattr(r.captions[0], "boxes", None) is not None for r in shown]
    said = []
    if any(r.layout is not None for r in shown):
        said.append("For a model with attention over a grid, the best caption's words follow one by one, each on "
                    "the picture the model saw, lit where it looked while choosing that word.")
    if any(r.layout is not None and r.layout.prefix for r in shown):
        said.append("The bar along a picture's foot is the share of that word's attention on the tokens that have "
                    "no place in the image (a class token): full width is all of it.")
    if any(r.layout is None and not regions for r, regions in zip(shown, over_regions)):
        said.append("For an encoder whose tokens have no layout, each word's picture is a bar per token, as tall as "
                    "its weight.")
    said += sorted({f"No attention is shown: {r.attention_absent}." for r in results if r.attention_absent})
    if any(over_regions):
        said.append("For a model attending over regions (boxes), the best caption's words follow one by one, each "
                    "on the picture the model saw, where the box outlined in red is the region that word attended "
                    "to most.")
    return " ".join(said)


def gallery_html(results: list[Result], title: str = "captioning gallery") -> str:
    """A self-contained HTML page; every caption and file name is escaped."""
    cards = []
    for r in results:
        name = html.escape(r.path)  # as given: two photo.jpg in different folders must look different
        if r.error:
            body = f'<p class="error">{html.escape(r.error)}</p>'
            image = ""
        else:
            items = "".join(f"<li>{html.escape(c)} <span class=\"score\">{lp:.2f}</span></li>" for c, lp in r.captions)
            body = f"<ol>{items}</ol>" + (_attention_row(r) if r.attends else "")
            image = f'<img src="{_thumbnail(r.data)}" alt="{html.escape(os.path.basename(r.path))}">'
        cards.append(f'<figure>{image}<figcaption><b>{name}</b>{body}</figcaption></figure>')
    style = ("body{font-family:sans-serif;margin:2em;background:#fafafa}figure{display:inline-block;vertical-align:top;"
             "width:280px;margin:0 1em 1em 0;background:#fff;padding:.6em;border:1px solid #ddd}img{max-width:256px}"
             ".score{color:#888;font-size:80%}.error{color:#b00}ol{padding-left:1.2em}b{word-break:break-all}"
             ".attention{margin-top:.4em}.word{display:inline-block;text-align:center;font-size:80%;margin:0 2px 4px 0}"
             ".word img{width:72px;height:72px;image-rendering:auto}")
    legend = ('<p class="legend">Each image with its captions, best first. The grey number after a caption is its '
              "log-probability under the model: the sum of the log-probabilities of its words and of the end of "
              "the caption (0 would be certain; closer to 0 is more likely). " + _attention_legend(results) + "</p>")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>\n{legend}\n" + "\n".join(cards) +
            "\n</body></html>\n")


def write_gallery(path: str, results: list[Result], title: str) -> None:
    """Writes the gallery atomically; the caller checked ``path`` first (``fileio.check_output_file``)."""
    atomic_write_bytes(path, gallery_html(results, title).encode("utf-8"))


def json_record(r: Result) -> dict:
    """The ``--json`` record of a captioned image (``captioning serve`` answers with the same records):
    ``image`` (its path), ``captions`` (each ``caption`` and ``log_prob``, best first; for an attention decoder
    ``attention``: per word its weights over the tokens in their order or over the regions) and where those
    weights sit: ``grid`` and ``prefix_tokens``, ``tokens`` or ``regions`` (module docstring). A language-model
    decoder's (``model.decoder: prefix_lm``) says it has none: ``"attention": null`` and ``attention_absent``, why.

    >>> from captioning.inference.captioner import Caption
    >>> json_record(Result("a.jpg", captions=[Caption("a red circle", -1.2345678)]))
    {'image': 'a.jpg', 'captions': [{'caption': 'a red circle', 'log_prob': -1.234568}]}
    """
    captions = []
    for c in r.captions:
        entry = {"caption": c.text, "log_prob": round(c.log_prob, 6)}
        if r.attends:  # per word, its weights over the tokens (in their order) or the regions
            entry["attention"] = [[round(float(x), 5) for x in word] for word in c.attention]
        captions.append(entry)
    regions = r.captions[0].boxes if r.captions else None
    where = ({"regions": [[round(float(x), 5) for x in box] for box in regions]} if regions is not None
             else {"grid": [r.layout.rows, r.layout.cols], "prefix_tokens": r.layout.prefix} if r.layout
             else {"tokens": len(r.captions[0].attention[0])} if r.attends and len(r.captions[0].attention)
             else {})
    if r.attention_absent:  # said, not left out: a language model's attention over its prefix cannot be read
        where = {"attention": None, "attention_absent": r.attention_absent}
    return {"image": r.path, "captions": captions, **where}


def print_results(results: list[Result], as_json: bool) -> int:
    """Captions on stdout, one error line per bad file on stderr; returns the exit code."""
    failures = 0
    for r in results:
        if r.error:
            failures += 1
            print(f"captioning caption: error: {r.path}: {r.error}", file=sys.stderr)
            continue
        if as_json:
            print(json.dumps(json_record(r), ensure_ascii=False))
        else:
            print(r.path)
            for c, lp in r.captions:
                print(f"  {lp:8.3f}  {c}")
    return 1 if failures else 0
