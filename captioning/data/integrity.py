"""Damaged TFRecord shards: find them, name them, or read around their bad records.

A shard can be damaged after ``prepare`` wrote it: a copy cut short, a disk's flipped bits, bytes
appended by a botched ``cat``, a file emptied or deleted. TensorFlow notices only while iterating,
deep inside the input pipeline, and says ``DataLossError: corrupted record at 12`` without naming the
file. This module turns that into one line naming the shard (exit code 2 from the command line), or,
with ``data.skip_corrupt: true``, skips the bad records and says how many.

The state of one command's reading lives on a :class:`ShardReader` that the command creates and passes
to the input pipeline: the files handed out, the scans made, the scratch folder of salvaged copies.

What is checked, and when:

* **Every time a dataset is built** (:meth:`ShardReader.files`, called by the input pipeline): each shard
  exists and has the size ``manifest.json`` records for it (``shard_bytes``, written by ``prepare``
  since this check exists; older manifests only get the existence check). One ``stat`` per file, no
  read: truncated, emptied and appended-to shards are refused before the first training step.
* **While reading**, TensorFlow checks each record's two CRC-32C checksums (length and data) and
  ``parse_example`` checks that it is a ``tf.train.Example`` with the schema's features. Damage that
  keeps the size (flipped bytes, a record replaced by another of the same length) surfaces there, as a
  ``tf.errors.DataLossError`` or ``InvalidArgumentError``. :meth:`ShardReader.named_errors` wraps a whole
  command (``train``, ``evaluate``): when such an error escapes, it scans the shards that the command's
  datasets read (:func:`scan_shard`) until it finds the damaged one, and raises an
  :class:`~captioning.errors.InputError` naming it, with the byte offset and what is wrong. When no shard
  is damaged the original error goes on (it was something else). No per-record Python runs on this
  path: the scan happens only after an error.
* **With ``data.skip_corrupt: true``**, every shard is scanned once per reader before it is read (in
  C++: TensorFlow's reader checks the CRCs and ``parse_example`` the records, about the cost of reading
  the split once without decoding images). An intact shard is read as it is. A damaged one is read
  record by record (TensorFlow's random-access record reader, which also checks both CRCs), and its
  intact, parsable records are copied to a scratch file that the pipeline reads instead (so the fast
  path, ``TFRecordDataset`` over files, stays the same; the scratch folder, ``captioning-salvaged-*``
  in the temporary directory, is removed when the reader is closed or collected, or the process exits,
  unless it is SIGKILLed). A warning line per damaged shard says how many records were skipped and why;
  the count is
  the manifest's ``shard_records`` minus the records kept, or, for older manifests, the number of
  damaged places. A missing shard counts all its records as skipped.

Reading around damage: when a record's length header is intact (its own CRC matches), only that record
is lost and reading continues right after it. When the header itself is damaged, or bytes were cut
out, the scanner looks for the next offset where 12 bytes form a valid header (length + masked
CRC-32C, computed with numpy over every offset) whose record also reads cleanly, and continues there;
``tf.data.experimental.ignore_errors`` would instead drop the whole rest of the file, and count nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import shutil
import tempfile
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning import tf_internals
from captioning.data import schema
from captioning.data.prepared import MANIFEST
from captioning.errors import InputError

log = logging.getLogger("captioning.data")

_HEADER = 12  # uint64 length + uint32 masked CRC-32C of the length
# What reading a bad record raises. TensorFlow quotes an unparsable record's bytes in its error message;
# when they are not UTF-8, Python cannot decode the message and a UnicodeDecodeError escapes instead.
_BAD_RECORD = (tf.errors.DataLossError, tf.errors.InvalidArgumentError, UnicodeDecodeError)
_FOOTER = 4  # uint32 masked CRC-32C of the data


# ---- finding record boundaries after damaged bytes -----------------------------------------------------------
def _crc_table() -> np.ndarray:
    """CRC-32C (Castagnoli, reflected 0x82F63B78) byte table."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1).astype(np.uint32)
    return table


_CRC_TABLE = _crc_table()


def _header_candidates(path: str, start: int, size: int, chunk: int = 1 << 22):
    """Offsets ≥ ``start`` whose 12 bytes are a valid TFRecord length header, in order: the masked
    CRC-32C of every 8-byte window at once, with numpy (about 10 ns per offset)."""
    with open(path, "rb") as f:
        pos = start
        while pos + _HEADER <= size:
            f.seek(pos)
            buf = np.frombuffer(f.read(chunk + _HEADER - 1), dtype=np.uint8)
            n = len(buf) - _HEADER + 1
            if n <= 0:
                return
            crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
            for k in range(8):
                crc = _CRC_TABLE[(crc ^ buf[k:k + n]) & 0xFF] ^ (crc >> np.uint32(8))
            crc ^= np.uint32(0xFFFFFFFF)
            masked = ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(schema.CRC_MASK_DELTA)
            stored = (buf[8:8 + n].astype(np.uint32) | (buf[9:9 + n].astype(np.uint32) << 8)
                      | (buf[10:10 + n].astype(np.uint32) << 16) | (buf[11:11 + n].astype(np.uint32) << 24))
            for i in np.flatnonzero(masked == stored):
                yield pos + int(i)
            pos += n


# ---- scanning one shard -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Damage:
    offset: int  # where the bad bytes start
    end: int  # where reading continued (the file's size: nothing after it could be read)
    reason: str


@dataclasses.dataclass
class ShardScan:
    """What :func:`scan_shard` found in one file."""

    path: str
    records: int  # intact records that parse
    size: int
    expected_records: int | None = None  # from manifest.json, when it records them
    expected_bytes: int | None = None
    damage: list[Damage] = dataclasses.field(default_factory=list)
    missing: bool = False

    @property
    def ok(self) -> bool:
        return (not self.missing and not self.damage
                and self.expected_records in (None, self.records) and self.expected_bytes in (None, self.size))

    @property
    def skipped(self) -> int:
        """Records lost: the manifest's count minus those kept, or (without it) the damaged places."""
        if self.expected_records is not None:
            return max(self.expected_records - self.records, 0)
        return len(self.damage)

    def describe(self) -> str:
        if self.missing:
            return "the file is missing"
        parts = [f"{d.reason} at byte {d.offset}" for d in self.damage[:3]]
        if len(self.damage) > 3:
            parts.append(f"{len(self.damage) - 3} more damaged place(s)")
        if self.expected_bytes is not None and self.size != self.expected_bytes:
            parts.append(f"{self.size} bytes where {MANIFEST} says {self.expected_bytes}")
        if self.expected_records is not None and self.records != self.expected_records:
            parts.append(f"{self.records} of its {self.expected_records} records readable")
        return "; ".join(parts) or "intact"


@functools.cache
def _parser():
    """One record's parse, compiled once per process (a pure function: nothing else is kept)."""
    return tf.function(lambda s: schema.parse_batch(tf.reshape(s, [1]))[schema.IMAGE_ID],
                       input_signature=[tf.TensorSpec([], tf.string)], autograph=False)


def _parses(record: bytes) -> bool:
    try:
        _parser()(tf.constant(record))
    except (tf.errors.InvalidArgumentError, UnicodeDecodeError):
        return False
    return True


def _fast_count(path: str) -> int:
    """The file's record count, every CRC checked and every record parsed, all in C++. Raises
    DataLossError / InvalidArgumentError at the first bad record."""
    ds = tf.data.TFRecordDataset(path, buffer_size=8 << 20).batch(256).map(do_not_convert(
        lambda s: tf.shape(schema.parse_batch(s)[schema.IMAGE_ID], out_type=tf.int64)[0]))
    return int(ds.reduce(tf.constant(0, tf.int64), do_not_convert(lambda total, n: total + n)))


def _resync(path: str, reader, offset: int, size: int) -> int:
    """Where reading can continue after a bad record at ``offset``."""
    with open(path, "rb") as f:
        f.seek(offset)
        head = f.read(_HEADER)
    if len(head) == _HEADER and schema.masked_crc32c(head[:8]) == int.from_bytes(head[8:], "little"):
        # the length is trustworthy: usually only this record's data is bad, and the next one follows
        after = offset + _HEADER + int.from_bytes(head[:8], "little") + _FOOTER
        if after == size:
            return size
        if after < size:
            try:
                reader.read(after)
                return after
            except (tf.errors.DataLossError, IndexError):
                pass  # bytes were cut out or inserted: look for the next record
    for candidate in _header_candidates(path, offset + 1, size):
        try:
            reader.read(candidate)
        except (tf.errors.DataLossError, IndexError):
            continue
        return candidate
    return size


def scan_shard(path: str, expected_records: int | None = None, expected_bytes: int | None = None,
               salvage_to: str | None = None) -> ShardScan:
    """Checks every record of ``path`` (both CRCs, and that it parses with the schema).

    With ``salvage_to``, a damaged file's intact records are written there, in order (an intact file
    is not copied). The fast path reads the file once in C++; only a damaged file is read again
    record by record.
    """
    if not os.path.isfile(path):
        return ShardScan(path, 0, 0, expected_records, expected_bytes, missing=True)
    size = os.path.getsize(path)
    scan = ShardScan(path, 0, size, expected_records, expected_bytes)
    try:
        scan.records = _fast_count(path)
    except _BAD_RECORD:
        pass
    else:
        if scan.ok:
            return scan
    scan.records = 0
    reader = tf_internals.tfrecord_random_reader(path)
    writer = tf.io.TFRecordWriter(salvage_to) if salvage_to else None
    try:
        offset = 0
        while offset < size:
            try:
                record, end = reader.read(offset)
            except (tf.errors.DataLossError, IndexError) as e:
                reason = "truncated record" if "truncated" in str(e) or isinstance(e, IndexError) \
                    else "corrupted record (CRC mismatch)"
                end = _resync(path, reader, offset, size)
                if end == size and scan.expected_records == scan.records:
                    reason = "bytes after the last record"  # every record is there: something was appended
                scan.damage.append(Damage(offset, end, reason))
                offset = end
                continue
            if _parses(record):
                scan.records += 1
                if writer:
                    writer.write(record)
            else:
                scan.damage.append(Damage(offset, end, "a record that is not a tf.train.Example of this schema"))
            offset = end
    finally:
        if writer:
            writer.close()
    return scan


_REMEDY = "prepare the dataset again, or set data.skip_corrupt: true to read only its intact records"


def _cheap_problem(path: str, expected_bytes: int | None) -> str | None:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "the file is missing"
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    if expected_bytes is not None and size != expected_bytes:
        how = "cut short" if size < expected_bytes else "with bytes appended"
        return f"{size} bytes where {MANIFEST} says {expected_bytes} ({how})"
    return None


_PARSE_ERROR = re.compile(r"parse ?example|could not parse", re.IGNORECASE)


class ShardReader:
    """The shards one command reads (``train``, ``evaluate``), checked against their dataset's manifest.

    Passed to the input pipeline (``make_dataset(..., shards=reader)``), which asks it for each split's
    files (:meth:`files`); it remembers them, so that :meth:`named_errors` can trace a ``DataLossError``
    to the damaged file. With ``skip_corrupt`` it scans each shard once (a cache per reader) and hands
    out copies of damaged shards' intact records, written to a scratch folder that :meth:`close` removes
    (and, failing that, the end of the process)."""

    def __init__(self, skip_corrupt: bool = False):
        self.skip_corrupt = skip_corrupt
        self.read: dict[str, tuple[int | None, int | None]] = {}  # every file handed out: expected sizes
        self._scans: dict[tuple, tuple[ShardScan, str | None]] = {}
        self._scratch: str | None = None
        self._cleanup = None

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # removes the scratch folder

    def _scratch_dir(self) -> str:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="captioning-salvaged-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._scratch, True)
        return self._scratch

    def _scan(self, path: str, expected: tuple[int | None, int | None],
              salvage: bool) -> tuple[ShardScan, str | None, bool]:
        """(scan, path of the salvaged copy or None, whether this call scanned): once per version of the file."""
        try:
            st = os.stat(path)
            key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, expected, salvage)
        except OSError:
            key = (os.path.realpath(path), None, None, expected, salvage)
        if key in self._scans:
            return (*self._scans[key], False)
        target = None
        if salvage:
            target = os.path.join(self._scratch_dir(), f"{len(self._scans):05d}-{os.path.basename(path)}")
        scan = scan_shard(path, *expected, salvage_to=target)
        if target and (scan.ok or not scan.records):  # nothing to read instead
            if os.path.exists(target):
                os.remove(target)
            target = None
        self._scans[key] = (scan, target)
        return scan, target, True

    def files(self, dataset, split: str, files: list[str] | None = None) -> list[str]:
        """The files the pipeline should read for ``split`` of ``dataset`` (a
        :class:`~captioning.data.prepared.PreparedDataset`), or for ``files`` of it (one input pipeline's share).

        Without ``skip_corrupt``: checks each file's existence and size against the manifest (one ``stat``
        each) and raises :class:`InputError` naming the first bad one; returns the files unchanged. With
        it: scans every file once, logs a warning per damaged one, and returns the list with each damaged
        file replaced by a copy of its intact records (dropped when none is left)."""
        expected = dataset.expected_sizes(split)
        files = list(expected) if files is None else files
        self.read.update({path: expected[path] for path in files})
        if not self.skip_corrupt:
            for path in files:
                problem = _cheap_problem(path, expected[path][1])
                if problem:
                    raise InputError(f"damaged shard {path}: {problem}; {_REMEDY}")
            return files
        out, damaged, skipped, fresh = [], 0, 0, False
        for path in files:
            scan, salvaged, scanned = self._scan(path, expected[path], salvage=True)
            if scan.ok:
                out.append(path)
                continue
            damaged += 1
            skipped += scan.skipped
            fresh = fresh or scanned
            if scanned:  # once per reader, not at every evaluation
                log.warning("data.skip_corrupt: %s: skipped %d record(s), kept %d (%s)", path, scan.skipped,
                            scan.records, scan.describe())
            if salvaged:
                out.append(salvaged)
        if fresh:
            log.warning("data.skip_corrupt: %d of %d shard(s) damaged, %d record(s) skipped in all", damaged,
                        len(files), skipped)
        if not out:
            raise InputError(f"no intact record left in {len(files)} shard(s) (first: {files[0]})")
        return out

    def find_damage(self) -> ShardScan | None:
        """The first damaged file among those handed out: cheap checks (missing, wrong size) on all of them
        first, then a full scan of each in turn. None when every file is intact."""
        for path, (records, size) in self.read.items():
            if _cheap_problem(path, size):
                return scan_shard(path, records, size)
        if len(self.read) > 1:
            log.info("checking %d shard(s) for damage", len(self.read))
        for path, expected in self.read.items():
            scan, _, _ = self._scan(path, expected, salvage=False)
            if not scan.ok:
                return scan
        return None

    @contextlib.contextmanager
    def named_errors(self):
        """Turns a damaged shard's ``DataLossError`` / parse ``InvalidArgumentError`` (or a shard deleted
        while reading: ``NotFoundError``; or the ``UnicodeDecodeError`` TensorFlow's message about a
        non-UTF-8 unparsable record causes) raised in the block into an :class:`InputError` naming the
        shard. Only this reader's files are scanned, and only after such an error; anything else, or an
        error no damaged file explains, passes through unchanged."""
        try:
            yield self
        except (*_BAD_RECORD, tf.errors.NotFoundError) as e:
            if isinstance(e, tf.errors.InvalidArgumentError) and not _PARSE_ERROR.search(str(e)):
                raise
            scan = self.find_damage() if self.read else None
            if scan is None:
                raise
            raise InputError(f"damaged shard {scan.path}: {scan.describe()}; {_REMEDY}") from None
