"""Every output is written under a temporary name and renamed when complete, and a full disk is one
clear line (prepare, train, evaluate, score, caption and export all use these)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from typing import IO, Iterable, Iterator

from captioning.errors import DiskFullError, InputError

# What a write into a full file system (or past a quota or a file-size limit) fails with.
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file is too large for this file system or process limit"}
_DISK_FULL_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                   "File too large": errno.EFBIG}


def disk_full_error(error: BaseException, path: str, what: str, then: str = "run the same command again",
                    params: tuple[str, ...] = ()) -> DiskFullError | None:
    """The one-line error for ``error`` when it means the disk (or a quota, or the process's file-size
    limit) is full while writing ``what`` to ``path``; None for any other error. TensorFlow's own file
    writers (checkpoints, SavedModels, tf.data caches) raise ``tf.errors.OpError``\\ s whose message
    carries the system's text, so both kinds are recognised. ``then`` says what to do once space is free
    (naming ``params``, as :class:`InputError`)."""
    code = getattr(error, "errno", None)
    if code not in _DISK_FULL:
        message = str(getattr(error, "message", None) or error)
        code = next((c for text, c in _DISK_FULL_TEXT.items() if text in message), None)
    if code is None:
        return None
    return DiskFullError(f"cannot write {what} to {path}: {_DISK_FULL[code]}; free space there (or write "
                         f"somewhere else), then {then}", params=params)


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb", tmp: str | None = None) -> Iterator[IO]:
    """The one way this project writes a file: yields a file object open on a temporary name beside
    ``path`` (``tmp``, default ``PATH.tmp<pid>``); when the block ends without error the file is flushed,
    fsynced and renamed over ``path``, so ``path`` is only ever absent, the old file, or complete. On
    any error the temporary file is removed and the error raised. A fixed ``tmp`` name is for writers
    whose next run clears such leftovers (``prepare``'s ``NAME.tmp`` shards): on an interrupt
    (KeyboardInterrupt, SystemExit) it stays, as it would after a kill, and only errors remove it.

    >>> import tempfile; folder = tempfile.mkdtemp()
    >>> with atomic_file(os.path.join(folder, "a.txt"), "w") as f:
    ...     _ = f.write("hello")
    ...     os.listdir(folder)  # doctest: +ELLIPSIS
    ['a.txt.tmp...']
    >>> os.listdir(folder), open(os.path.join(folder, "a.txt")).read()
    (['a.txt'], 'hello')
    """
    cleared_on = Exception if tmp else BaseException
    tmp = tmp or f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except cleared_on:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_folder(path: str) -> Iterator[str]:
    """The folder form of :func:`atomic_file`: yields an empty temporary folder beside ``path``
    (``PATH.tmp<pid>``) to fill; when the block ends without error it replaces ``path``
    (:func:`replace_folder`). On any error the temporary folder is removed and ``path`` is untouched. (The
    caller decides whether an existing ``path`` may be replaced.)"""
    tmp = f"{os.path.realpath(path)}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        yield tmp
        replace_folder(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(folder: str, path: str) -> None:
    """Renames the complete ``folder`` to ``path``: an existing ``path`` is moved aside first
    (``PATH.old<pid>``) and removed once the new one is in place; if the rename fails, the old one is put
    back. (Both on one file system.)"""
    target = os.path.realpath(path)
    old = f"{target}.old{os.getpid()}"
    moved_aside = False
    try:
        if os.path.isdir(target):
            os.replace(target, old)
            moved_aside = True
        os.replace(folder, target)
        moved_aside = False
    finally:
        if moved_aside:  # the new folder did not make it: the old one goes back
            os.replace(old, target)
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def clean_folder_leftovers(path: str) -> list[str]:
    """What :func:`atomic_folder` runs of dead processes (killed, ``kill -9``) left beside ``path``: a
    temporary folder ``PATH.tmp<pid>`` is removed; a folder moved aside, ``PATH.old<pid>``, is put back
    when ``path`` itself is missing (the kill came between the two renames) and removed otherwise.
    Folders of live processes are left alone. Returns the names handled."""
    target = os.path.realpath(path)
    parent, base = os.path.dirname(target), os.path.basename(target)
    handled = []
    try:
        names = os.listdir(parent)
    except OSError:
        return handled
    for name in sorted(names):
        rest = name[len(base):] if name.startswith(base) else ""
        kind, pid = rest[:4], rest[4:]
        if kind not in (".tmp", ".old") or not pid.isdigit() or _alive(int(pid)):
            continue
        leftover = os.path.join(parent, name)
        if kind == ".old" and not os.path.exists(target):
            os.replace(leftover, target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
        handled.append(name)
    return handled


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_record(path: str, keys) -> dict | None:
    """The JSON mapping a command wrote at ``path`` to say what it made (``lm train``'s, ``clip train``'s
    ``training.json``), when it holds every one of ``keys``; None when it is missing, damaged or another file."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and set(keys) <= set(record) else None


def atomic_write_json(path: str, obj, indent: int | None = 1) -> None:
    """JSON with sorted keys (same object, same bytes), written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def make_dirs(path: str, what: str, params: tuple[str, ...] = ()) -> None:
    """``os.makedirs(path, exist_ok=True)``, or one line naming ``what`` (e.g. the parameter
    ``output_dir``, listed in ``params``: :class:`InputError`) and why not: a file in the way, a path under
    a file or under ``/proc`` or ``/sys``, no permission."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{what} {path} is a file, not a folder", params=params)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InputError(f"{what} {path}: cannot create it ({e.strerror or e})", params=params) from None


def _kind(path: str) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("a folder", "a FIFO", ...); None for a
    regular file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


_LOOKS = {"html": (b"<!doctype html", b"<html"), "json": (b"{", b"[")}
_MAGIC = ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"), (b"GIF8", "a GIF image"), (b"BM", "a BMP image"),
          (b"%PDF", "a PDF document"), (b"PK\x03\x04", "a zip archive"), (b"\x1f\x8b", "a gzip file"))


def _looks_like(path: str, kind: str) -> str | None:
    """None when the regular file ``path`` starts as a ``kind`` file (``html``, ``json``: what this
    project writes) or is empty; else what it seems to be instead ("a JPEG image", "another file")."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    stripped = head.lstrip().lower()
    if not stripped or stripped.startswith(_LOOKS[kind]):
        return None
    return next((name for magic, name in _MAGIC if head.startswith(magic)), "another kind of file")


# the largest existing JSON file read to tell whether this command wrote it (its outputs are far smaller)
_MAX_JSON_READ = 64 << 20


def _json_written(path: str, keys: tuple[str, ...]) -> bool:
    """Whether the file ``path`` is a JSON object holding every one of ``keys`` (how a command recognises
    the JSON it wrote, see :func:`check_output_file`), or is empty."""
    try:
        if os.path.getsize(path) == 0:
            return True
        if os.path.getsize(path) > _MAX_JSON_READ:
            return False
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(key in data for key in keys)


def _within(path: str, folder: str) -> bool:
    """True when ``path`` is ``folder`` or lies inside it (both resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def refuse_inputs(path: str, what: str, params: tuple[str, ...] = (), inputs: Iterable[str] = (),
                  read_folders: dict[str, str] | None = None, contains: bool = False) -> None:
    """The one rule of every output path of the command line: it is never one of the command's inputs. An
    InputError naming ``what`` when ``path`` is empty, is (the same file as) one of the files ``inputs``, or
    is or lies inside one of ``read_folders`` (``{folder: what it is}``: a prepared dataset, a keras-hub
    preset, a model folder's own files are :meth:`captioning.model.folder.ModelDir.refuse_output`'s), any of
    which the write would replace or change. ``contains`` (an output folder, which a rerun may replace
    whole): also when an input lies inside ``path``. Inputs that do not exist are skipped."""
    if not path.strip():
        raise InputError(f"{what} is empty: give the name of the output to write", params=params)
    for given in inputs:
        if not given or not os.path.exists(given):
            continue
        if (os.path.exists(path) and os.path.samefile(path, given)) or os.path.realpath(path) == \
                os.path.realpath(given) or (contains and _within(given, path)):
            raise InputError(f"{what} {path} is also an input ({given}): writing it would overwrite that input; give "
                             "another name", params=params)
    for folder, name in (read_folders or {}).items():
        if not folder or not os.path.isdir(folder):
            continue
        if _within(path, folder) or (contains and _within(folder, path)):
            where = "is" if os.path.realpath(path) == os.path.realpath(folder) else \
                ("holds" if contains and _within(folder, path) else "lies inside")
            raise InputError(f"{what} {path} {where} {name} {folder}, which this command reads: writing there would "
                             "change an input; give a name outside it", params=params)


def check_output_file(path: str, what: str, params: tuple[str, ...] = (), inputs: Iterable[str] = (),
                      kind: str | None = None, keys: tuple[str, ...] = (),
                      read_folders: dict[str, str] | None = None) -> None:
    """Makes sure ``path`` can be written *before* the work that produces it, and that writing it destroys
    nothing but an earlier output: it must not be empty, must be a regular file or not exist (a device, a
    FIFO, a socket or a symbolic link would be *replaced* by the rename that completes the write:
    ``--html /dev/null`` as root would replace /dev/null), it must not be one of the command's inputs
    (:func:`refuse_inputs`: ``inputs``, files; ``read_folders``, folders: ``caption --html photo.jpg
    other.jpg`` would overwrite the photo, ``evaluate --output DATA/manifest.json`` the dataset's manifest),
    its folder is created if missing, and a file really can be written there (a probe of a few KiB, removed
    at once: only trying tells a read-only or pseudo file system, even for root, or a disk already full).
    With ``kind`` (``"html"``, ``"json"``) an existing file is replaced only when it is one of that kind, an
    earlier output: ``caption --html photo.jpg other.jpg``, ``--html`` used as if it took no value, must not
    turn the photo into a web page. With ``keys`` (JSON) only a JSON object holding all of them is: what
    this command writes always holds them (``evaluate``: ``metrics``, ``split``, ``checkpoint_step``;
    ``score``: ``metrics``; ``benchmark``: ``benchmark``), a dataset's manifest or a preset's config.json
    does not. An empty file may always be replaced (nothing is lost). One line naming ``what`` otherwise
    (:class:`DiskFullError` for a full disk)."""
    refuse_inputs(path, what, params, (), read_folders)  # empty; inside a folder read (files: below)
    found = _kind(path)
    if found == "a folder" or (path.endswith(os.sep) and not found):
        raise InputError(f"{what} {path} is a folder; give a file name", params=params)
    if found:
        raise InputError(f"{what} {path} is {found}, not a regular file: writing it would replace it; give the name "
                         "of a file", params=params)
    other = _looks_like(path, kind) if kind and os.path.isfile(path) else None
    if other:
        raise InputError(f"{what} {path} exists and is {other}, not {kind.upper()} this command wrote: writing would "
                         f"overwrite it; {what} takes the name of the {kind.upper()} file to write", params=params)
    refuse_inputs(path, what, params, inputs)
    if keys and os.path.isfile(path) and not _json_written(path, keys):
        raise InputError(f"{what} {path} exists and is not a result this command wrote (no {', '.join(keys)} in it): "
                         "writing would overwrite it; give a new file name", params=params)
    make_dirs(os.path.dirname(os.path.abspath(path)), f"{what} {path}: its folder", params)
    probe = f"{path}.tmp{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if os.path.exists(probe):
            os.remove(probe)
        raise disk_full_error(e, path, what) or InputError(f"{what} {path}: cannot write it ({e.strerror or e})",
                                                           params=params) from None
    os.remove(probe)


def check_output_folder(path: str, what: str, params: tuple[str, ...] = (), inputs: Iterable[str] = (),
                        read_folders: dict[str, str] | None = None, contains: bool = False) -> None:
    """:func:`check_output_file`'s rule for an output that is a folder (``prepare --output-dir``, ``train
    --model-dir``, a work folder): not empty, not a file, not one of the ``inputs`` (files or folders) nor
    inside one of ``read_folders``; with ``contains`` (a command that may replace the folder whole) holding
    no input either. Writes nothing; each command makes the folder when its work starts (:func:`make_dirs`)
    and keeps its own rules for what may already be inside (``prepare``'s manifest, an export's marker)."""
    refuse_inputs(path, what, params, inputs, read_folders, contains)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{what} {path} is a file, not a folder", params=params)
