"""``captioning serve``'s JSON API: what a ``POST /caption`` may hold, and what it answers.

A request is ``multipart/form-data`` (what ``curl -F`` and a browser's ``FormData`` send) with these fields:

- ``image``, one or more: an image file each (any format Pillow reads; read exactly as ``captioning caption``
  reads a file: :func:`captioning.inference.caption.model_bytes`). Its file name is the record's ``image``.
- ``decode.KEY``: a decoding option for this request, as ``--set decode.KEY=VALUE`` takes it (e.g.
  ``decode.beam_size=5``, ``decode.method=sample``, ``decode.bad_endings=english``), typed and checked by the
  same settings engine (:class:`captioning.config.sections.DecodeConfig`) over the server's own options;
- ``pictures``: ``1`` (or ``true``) to get, for an attention decoder, each word of the best caption with its
  attention picture (the gallery's of ``caption --html``) as a PNG data URI.

The answer (HTTP 200) is a JSON list, one record per image in the order sent: the record
``captioning caption --json`` prints (:func:`captioning.inference.caption.json_record`), plus with
``pictures=1`` ``"pictures": [{"word": "red", "src": "data:image/png;base64,..."}, ...]``. An image that cannot
be read gets ``{"image": NAME, "error": "one line"}`` (as ``caption`` gives a file one error line); when no
image of the request is usable the answer is HTTP 400 ``{"error": ..., "results": [those records]}``.

Every other problem is one JSON line ``{"error": "..."}`` with its status: 400 for a malformed body, an unknown
field, a bad option (the settings engine's message) or no ``image`` field; 413 for a body over the upload bound
or more images than the per-request bound (:class:`Limits`).

>>> form = Form([("decode.beam_size", "", b"2"), ("image", "a.jpg", b"...")])
>>> form.images, form.options
([('a.jpg', b'...')], ['decode.beam_size=2'])
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import threading
import typing

from werkzeug.http import parse_options_header
from werkzeug.sansio import multipart

from captioning.config.sections import DecodeConfig
from captioning.errors import InputError
from captioning.images import ImageError
from captioning.inference.caption import Result, json_record, model_bytes, word_pictures

MAX_FIELD_BYTES = 10_000  # a text field's value (decode.bad_endings lists words)
CHUNK = 64 * 1024  # bytes of a body fed to the multipart decoder at a time
MAX_HEAD_BYTES = 16 * 1024  # before the first boundary, and a part's headers
_HEAD_STATES = (multipart.State.PREAMBLE, multipart.State.PART)

# Pillow's decompression-bomb limit is a module global that model_bytes lifts while it decodes a huge image
# (captioning.images): the request threads decode their uploads one at a time.
_DECODE = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may hold: ``max_upload_mb`` megabytes of body (``--max-upload-mb``, default 32; a larger
    request is refused before its body is read) and ``max_images`` images (``--max-images``, default 32)."""

    max_upload_mb: int = 32
    max_images: int = 32

    @property
    def max_bytes(self) -> int:
        return self.max_upload_mb * 1024 * 1024


class ApiError(Exception):
    """A request refused: its HTTP status and one line; ``results``: per-image records to answer with."""

    def __init__(self, status: int, message: str, results: list | None = None):
        super().__init__(message)
        self.status, self.results = status, results


def parse_multipart(content_type: str, body: bytes | typing.Iterable[bytes]
                    ) -> list[tuple[str, str | None, bytes]]:
    """The parts of a ``multipart/form-data`` body as ``(field name, file name or None, bytes)``; an
    :class:`ApiError` (400) when the body is not such a form (no boundary, no closing boundary: a truncated
    upload, a part without a name).

    ``body``: the bytes, or the body's pieces as they were read. It is parsed as a stream by Werkzeug's
    multipart decoder (``werkzeug.sansio.multipart``; TensorBoard's web server brings Werkzeug already), fed
    :data:`CHUNK` bytes at a time, so the parse holds the parts' own bytes and about a chunk more; a preamble
    or a part's headers over :data:`MAX_HEAD_BYTES` is refused. Python's ``email`` parser, used before, held
    about 10x the upload and spent about 1.5 CPU s a MB on a part of newlines (docs/serving.md, measured). A
    part's ``Content-Transfer-Encoding`` is not applied: RFC 7578 deprecates it, and browsers and curl send none."""
    kind, params = parse_options_header(content_type)
    if kind.lower() != "multipart/form-data":
        raise ApiError(400, f"send the images as multipart/form-data (curl -F image=@photo.jpg), not "
                            f"{content_type.split(';')[0].strip() or 'a body without a Content-Type'}")
    boundary = params.get("boundary", "")
    if not boundary or len(boundary) > 70 or not boundary.isascii():  # RFC 2046: 1 to 70 ASCII characters
        raise ApiError(400, "malformed multipart/form-data body (no boundary in its Content-Type)")
    pieces = [body] if isinstance(body, (bytes, bytearray, memoryview)) else body
    chunks = (view[i:i + CHUNK] for piece in pieces for view in [memoryview(piece)] for i in range(0, len(view), CHUNK))
    decoder, parts, part, ended = multipart.MultipartDecoder(boundary.encode("ascii")), [], None, False
    try:
        for chunk in itertools.chain(chunks, [None]):
            decoder.receive_data(chunk)
            while not isinstance(event := decoder.next_event(), multipart.NeedData):
                if isinstance(event, (multipart.Field, multipart.File)):
                    disposition, _ = parse_options_header(event.headers.get("Content-Disposition", ""))
                    if disposition.lower() != "form-data" or not event.name:
                        raise ApiError(400, "malformed multipart/form-data body: a part without "
                                            "Content-Disposition: form-data; name=...")
                    part = (event.name, getattr(event, "filename", None), io.BytesIO())
                elif isinstance(event, multipart.Data) and part is not None:
                    part[2].write(event.data)
                    if not event.more_data:
                        parts.append((part[0], part[1], part[2].getvalue()))  # no copy
                        part = None
                elif isinstance(event, multipart.Epilogue):
                    ended = True
                    break
            if decoder.state in _HEAD_STATES and len(decoder.buffer) > MAX_HEAD_BYTES:  # searched, not found
                raise ApiError(400, f"malformed multipart/form-data body (no boundary, or a part's headers not "
                                    f"ended, within {MAX_HEAD_BYTES:,} bytes)")
    except ValueError as e:  # the decoder's: a body cut short, not a form; a header that is not UTF-8
        said = "it ends before its closing boundary" if chunk is None else (
            str(e).splitlines()[0][:100] if str(e) else type(e).__name__)
        raise ApiError(400, f"malformed multipart/form-data body ({said})") from None
    if not ended:
        raise ApiError(400, "malformed multipart/form-data body (no closing boundary)")
    if not parts:
        raise ApiError(400, "malformed multipart/form-data body (no parts)")
    return parts


class Form:
    """A request's fields (module docstring): ``images`` as ``(file name, bytes)``, ``options`` as
    ``decode.KEY=VALUE`` overrides, ``pictures``. An :class:`ApiError` (400) for any other field."""

    def __init__(self, parts: list[tuple[str, str | None, bytes]]):
        self.images, self.options, self.pictures = [], [], False
        for name, filename, data in parts:
            if name == "image":
                self.images.append((filename or f"image {len(self.images) + 1}", data))
                continue
            if len(data) > MAX_FIELD_BYTES:
                raise ApiError(400, f"field {name!r}: at most {MAX_FIELD_BYTES:,} bytes")
            text = data.decode("utf-8", "replace")
            if name.startswith("decode."):
                self.options.append(f"{name}={text}")
            elif name == "pictures":
                if text.strip().lower() not in ("0", "1", "true", "false", ""):
                    raise ApiError(400, f"field 'pictures' must be 1 or 0, got {text[:40]!r}")
                self.pictures = text.strip().lower() in ("1", "true")
            else:
                raise ApiError(400, f"unknown field {name[:60]!r}: the fields are image (files), decode.KEY "
                                    "(decoding options) and pictures")


def decode_options(base: DecodeConfig, overrides: list[str]) -> DecodeConfig:
    """The server's options ``base`` with a request's ``decode.KEY=VALUE`` overrides, typed and checked as
    ``--set decode.KEY=VALUE`` is; an :class:`ApiError` (400) with the settings engine's one line otherwise."""
    try:
        return base.with_overrides(overrides)
    except InputError as e:
        raise ApiError(400, str(e)) from None


def read_images(form: Form) -> list[Result]:
    """A result per uploaded image, ``data`` the bytes the model reads or ``error`` why it cannot."""
    results = []
    for name, data in form.images:
        result = Result(name)
        try:
            with _DECODE:
                result.data = model_bytes(data)
        except ImageError as e:
            result.error = str(e)
        results.append(result)
    return results


def records(results: list[Result], pictures: bool) -> list[dict]:
    """The answer's records (module docstring), of results captioned (:meth:`Result.captioned`) or refused."""
    out = []
    for r in results:
        if r.error:
            out.append({"image": r.path, "error": r.error})
            continue
        record = json_record(r)
        if pictures and r.attends:
            record["pictures"] = [{"word": word, "src": src} for word, src, _ in word_pictures(r)]
        out.append(record)
    return out


def check_usable(results: list[Result]) -> None:
    """An :class:`ApiError` (400) with every image's error record when none of them can be captioned."""
    if results and all(r.error for r in results):
        first = results[0]
        raise ApiError(400, f"no usable image: {first.path}: {first.error}" +
                       (f" (and {len(results) - 1} more)" if len(results) > 1 else ""),
                       [{"image": r.path, "error": r.error} for r in results])
