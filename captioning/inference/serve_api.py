"""``captioning serve``'s JSON API: what a ``POST /caption`` may hold, and what it answers.

A request is ``multipart/form-data`` (what ``curl -F`` and a browser's ``FormData`` send) with these fields:

- ``image``, one or more: an image file each (any format Pillow reads; read exactly as ``captioning caption``
  reads a file: :func:`captioning.inference.caption.model_bytes`). Its file name is the record's ``image``.
- ``decode.KEY``: a decoding option for this request, as ``--set decode.KEY=VALUE`` takes it (e.g.
  ``decode.beam_size=5``, ``decode.method=sample``, ``decode.bad_endings=english``), typed and checked by the
  same settings engine (:class:`captioning.config_sections.DecodeConfig`) over the server's own options;
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
import email.parser
import email.policy
import threading

from captioning.config_sections import DecodeConfig
from captioning.errors import InputError
from captioning.images import ImageError
from captioning.inference.caption import Result, json_record, model_bytes, word_pictures

MAX_FIELD_BYTES = 10_000  # a text field's value (decode.bad_endings lists words)

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


def parse_multipart(content_type: str, body: bytes) -> list[tuple[str, str | None, bytes]]:
    """The parts of a ``multipart/form-data`` body as ``(field name, file name or None, bytes)``, parsed by the
    standard library's ``email`` parser; an :class:`ApiError` (400) when the body is not such a form (no
    boundary, no closing boundary: a truncated upload, a part without a name)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, f"send the images as multipart/form-data (curl -F image=@photo.jpg), not "
                            f"{content_type.split(';')[0].strip() or 'a body without a Content-Type'}")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    broken = [type(d).__name__ for d in message.defects]
    if not message.is_multipart() or broken:
        raise ApiError(400, "malformed multipart/form-data body" + (f" ({', '.join(broken)})" if broken else
                                                                     " (no parts)"))
    parts = []
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name or part.get_content_disposition() != "form-data":
            raise ApiError(400, "malformed multipart/form-data body: a part without Content-Disposition: "
                                "form-data; name=...")
        data = part.get_payload(decode=True)
        parts.append((str(name), part.get_filename(), data if data is not None else b""))
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
