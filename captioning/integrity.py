"""Damaged TFRecord shards: find them, name them, or read around their bad records.

A shard can be damaged after ``prepare`` wrote it: a copy cut short, a disk's flipped bits, bytes
appended by a botched ``cat``, a file emptied or deleted. TensorFlow notices only while iterating,
deep inside the input pipeline, and says ``DataLossError: corrupted record at 12`` without naming the
file. This module turns that into one line naming the shard (exit code 2 from the command line), or,
with ``data.skip_corrupt: true``, skips the bad records and says how many.

What is checked, and when:

* **Every time a dataset is built** (:func:`readable_files`, called by the input pipeline): each shard
  exists and has the size ``manifest.json`` records for it (``shard_bytes``, written by ``prepare``
  since this check exists; older manifests only get the existence check). One ``stat`` per file, no
  read: truncated, emptied and appended-to shards are refused before the first training step.
* **While reading**, TensorFlow checks each record's two CRC-32C checksums (length and data) and
  ``parse_example`` checks that it is a ``tf.train.Example`` with the schema's features. Damage that
  keeps the size (flipped bytes, a record replaced by another of the same length) surfaces there, as a
  ``tf.errors.DataLossError`` or ``InvalidArgumentError``. :func:`data_errors` wraps a whole command
  (``train``, ``evaluate``): when such an error escapes, it scans the shards that the command's datasets
  read (:func:`scan_shard`) until it finds the damaged one, and raises an
  :class:`~captioning.errors.InputError` naming it, with the byte offset and what is wrong. When no shard
  is damaged the original error goes on (it was something else). No per-record Python runs on this
  path: the scan happens only after an error.
* **With ``data.skip_corrupt: true``**, every shard is scanned once per process before it is read (in
  C++: TensorFlow's reader checks the CRCs and ``parse_example`` the records, about the cost of reading
  the split once without decoding images). An intact shard is read as it is. A damaged one is read
  record by record (TensorFlow's random-access record reader, which also checks both CRCs), and its
  intact, parsable records are copied to a scratch file that the pipeline reads instead (so the fast
  path, ``TFRecordDataset`` over files, stays the same; the scratch folder, ``captioning-salvaged-*``
  in the temporary directory, is removed when the process exits, unless it is SIGKILLed). A warning line per damaged shard says how many records were skipped and why; the count is
  the manifest's ``shard_records`` minus the records kept, or, for older manifests, the number of
  damaged places. A missing shard counts all its records as skipped.

Reading around damage: when a record's length header is intact (its own CRC matches), only that record
is lost and reading continues right after it. When the header itself is damaged, or bytes were cut
out, the scanner looks for the next offset where 12 bytes form a valid header (length + masked
CRC-32C, computed with numpy over every offset) whose record also reads cleanly, and continues there;
``tf.data.experimental.ignore_errors`` would instead drop the whole rest of the file, and count nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from captioning import records as records_lib
from captioning import schema
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
            masked = ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(records_lib.MASK_DELTA)
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
            parts.append(f"{self.size} bytes where {schema.MANIFEST} says {self.expected_bytes}")
        if self.expected_records is not None and self.records != self.expected_records:
            parts.append(f"{self.records} of its {self.expected_records} records readable")
        return "; ".join(parts) or "intact"


_parse_one = None


def _parses(record: bytes) -> bool:
    global _parse_one
    if _parse_one is None:
        _parse_one = tf.function(lambda s: schema.parse_batch(tf.reshape(s, [1]))[schema.IMAGE_ID],
                                 input_signature=[tf.TensorSpec([], tf.string)])
    try:
        _parse_one(tf.constant(record))
    except (tf.errors.InvalidArgumentError, UnicodeDecodeError):
        return False
    return True


def _fast_count(path: str) -> int:
    """The file's record count, every CRC checked and every record parsed, all in C++. Raises
    DataLossError / InvalidArgumentError at the first bad record."""
    ds = tf.data.TFRecordDataset(path, buffer_size=8 << 20).batch(256).map(
        lambda s: tf.shape(schema.parse_batch(s)[schema.IMAGE_ID], out_type=tf.int64)[0])
    return int(ds.reduce(tf.constant(0, tf.int64), lambda total, n: total + n))


def _resync(path: str, reader, offset: int, size: int) -> int:
    """Where reading can continue after a bad record at ``offset``."""
    with open(path, "rb") as f:
        f.seek(offset)
        head = f.read(_HEADER)
    if len(head) == _HEADER and records_lib.masked_crc32c(head[:8]) == int.from_bytes(head[8:], "little"):
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
    from tensorflow.python.lib.io import tf_record  # the random-access reader has no public tf.io name

    scan.records = 0
    reader = tf_record.tf_record_random_reader(path)
    writer = records_lib.RecordWriter(salvage_to) if salvage_to else None
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


# ---- the manifest's expectations ------------------------------------------------------------------------------
def expected_sizes(files: list[str]) -> dict[str, tuple[int | None, int | None]]:
    """path → (records, bytes) as the ``manifest.json`` beside each file records them (None: not
    recorded, e.g. a manifest written before ``shard_records``/``shard_bytes`` existed)."""
    out: dict[str, tuple[int | None, int | None]] = {}
    manifests: dict[str, dict] = {}
    for path in files:
        folder, name = os.path.split(path)
        if folder not in manifests:
            try:
                with open(os.path.join(folder, schema.MANIFEST), encoding="utf-8") as f:
                    manifests[folder] = json.load(f)
            except (OSError, ValueError):
                manifests[folder] = {}
        records = size = None
        for split in manifests[folder].get("splits", {}).values():
            shards = split.get("shards", [])
            if name in shards:
                i = shards.index(name)
                if len(split.get("shard_records", [])) == len(shards):
                    records = split["shard_records"][i]
                if len(split.get("shard_bytes", [])) == len(shards):
                    size = split["shard_bytes"][i]
        out[path] = (records, size)
    return out


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
        return f"{size} bytes where {schema.MANIFEST} says {expected_bytes} ({how})"
    return None


# ---- what the input pipeline calls ------------------------------------------------------------------------------
_watched: list[dict[str, None]] = []  # one ordered set of files per active data_errors() block
_scans: dict[tuple, tuple[ShardScan, str | None]] = {}
_scratch: str | None = None


def _scratch_dir() -> str:
    global _scratch
    if _scratch is None:
        _scratch = tempfile.mkdtemp(prefix="captioning-salvaged-")
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def _scan_cached(path: str, expected: tuple[int | None, int | None],
                 salvage: bool) -> tuple[ShardScan, str | None, bool]:
    """(scan, path of the salvaged copy or None, whether this call scanned): once per process and
    version of the file."""
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, expected, salvage)
    except OSError:
        key = (os.path.realpath(path), None, None, expected, salvage)
    if key in _scans:
        return (*_scans[key], False)
    target = None
    if salvage:
        target = os.path.join(_scratch_dir(), f"{len(_scans):05d}-{os.path.basename(path)}")
    scan = scan_shard(path, *expected, salvage_to=target)
    if target and (scan.ok or not scan.records):  # nothing to read instead
        if os.path.exists(target):
            os.remove(target)
        target = None
    _scans[key] = (scan, target)
    return scan, target, True


def readable_files(files: list[str], skip_corrupt: bool) -> list[str]:
    """The files the pipeline should read (see the module docstring).

    ``skip_corrupt=False``: checks each file's existence and size against the manifest (one ``stat``
    each) and raises :class:`InputError` naming the first bad one; returns ``files`` unchanged.
    ``skip_corrupt=True``: scans every file once per process, logs a warning per damaged one, and
    returns the list with each damaged file replaced by a copy of its intact records (dropped when
    none is left).
    """
    for watched in _watched:
        watched.update(dict.fromkeys(files))
    expected = expected_sizes(files)
    if not skip_corrupt:
        for path in files:
            problem = _cheap_problem(path, expected[path][1])
            if problem:
                raise InputError(f"damaged shard {path}: {problem}; {_REMEDY}")
        return files
    out, damaged, skipped, fresh = [], 0, 0, False
    for path in files:
        scan, salvaged, scanned = _scan_cached(path, expected[path], salvage=True)
        if scan.ok:
            out.append(path)
            continue
        damaged += 1
        skipped += scan.skipped
        fresh = fresh or scanned
        if scanned:  # once per process, not at every evaluation
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


_PARSE_ERROR = re.compile(r"parse ?example|could not parse", re.IGNORECASE)


def find_damage(files) -> ShardScan | None:
    """The first damaged file of ``files``: cheap checks (missing, wrong size) on all of them first,
    then a full scan of each in turn. None when every file is intact."""
    files = list(files)
    expected = expected_sizes(files)
    for path in files:
        if _cheap_problem(path, expected[path][1]):
            return scan_shard(path, *expected[path])
    if len(files) > 1:
        log.info("checking %d shard(s) for damage", len(files))
    for path in files:
        scan, _, _ = _scan_cached(path, expected[path], salvage=False)
        if not scan.ok:
            return scan
    return None


@contextlib.contextmanager
def data_errors():
    """Turns a damaged shard's ``DataLossError`` / parse ``InvalidArgumentError`` (or a shard deleted
    while reading: ``NotFoundError``; or the ``UnicodeDecodeError`` TensorFlow's message about a
    non-UTF-8 unparsable record causes) raised anywhere in the block into an :class:`InputError` naming
    the shard. Only the files of datasets built inside the block are scanned, and only after such an
    error; anything else, or an error no damaged file explains, passes through unchanged. Usable as a
    decorator."""
    files: dict[str, None] = {}
    _watched.append(files)
    try:
        yield
    except (*_BAD_RECORD, tf.errors.NotFoundError) as e:
        if isinstance(e, tf.errors.InvalidArgumentError) and not _PARSE_ERROR.search(str(e)):
            raise
        scan = find_damage(files) if files else None
        if scan is None:
            raise
        raise InputError(f"damaged shard {scan.path}: {scan.describe()}; {_REMEDY}") from None
    finally:
        for i, watched in enumerate(_watched):
            if watched is files:
                del _watched[i]
                break
