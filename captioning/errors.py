"""Errors that the command line turns into one clear line instead of a traceback.

`InputError` means the user gave something we cannot use (a missing file, malformed JSON, an unknown
option value). The command line prints ``captioning <command>: error: <message>`` on stderr and exits
with code 2, the Unix convention for usage errors (argparse uses it too). Anything else that escapes is a
bug and keeps its traceback.

Library code names *parameters*, not command-line flags: ``prepare(opts)`` says "pass `overwrite=True`
to replace it", and lists the parameters its message names in ``params``. The command line rewrites each
to the flag it came from (:meth:`InputError.for_flags`), so the same error reads "pass --overwrite to
replace it" there. A parameter is marked in the message with backticks: its Python name, or
``name=True`` for a boolean switch. Only marked names are rewritten, so a value that happens to spell a
parameter (a folder named ``overwrite``, a split named ``vocab``) is printed as it is.

>>> e = InputError("overwrite already holds a dataset: pass `overwrite=True`; `min_word_count` must be >= 1",
...                params=("overwrite", "min_word_count"))
>>> e.for_flags({"overwrite": "--overwrite", "min_word_count": "--min-word-count"})
'overwrite already holds a dataset: pass --overwrite; --min-word-count must be >= 1'
"""

import re
from typing import Mapping


class InputError(Exception):
    """Bad input from the user: printed as one line, exit code 2. ``params``: the parameters (Python
    names) the message names, for :meth:`for_flags`."""

    exit_code = 2

    def __init__(self, message: str = "", params: tuple[str, ...] = ()):
        super().__init__(message)
        self.params = tuple(params)

    def __reduce__(self):  # kept across process boundaries (prepare's workers), params included
        return type(self), (str(self), self.params)

    def for_flags(self, flags: Mapping[str, str]) -> str:
        """The message with each of its parameters written as the flag ``flags`` maps it to."""
        message = str(self)
        for name in self.params:
            if name in flags:
                message = re.sub(rf"`{re.escape(name)}(=True)?`", flags[name], message)
        return message


class DiskFullError(InputError):
    """An output could not be written because the disk (or a quota, or the process's file-size limit) is
    full: one line naming the path and what to free, exit code 1 (the input itself was fine)."""

    exit_code = 1


class PeerLostError(InputError):
    """A worker of a multi-worker cluster is gone, or never came: one line naming it, exit code 1."""

    exit_code = 1


class ServiceLostError(InputError):
    """The tf.data service a run reads its input from is gone mid-run (its dispatcher unreachable, or
    restarted without its state): one line naming it, exit code 1 (the input itself was fine)."""

    exit_code = 1


def excerpt(value, limit: int = 80, quote: bool = True) -> str:
    """``repr(value)`` (a string's repr, quotes and escapes included; ``quote=False``: the text itself, on
    one line) cut to ``limit`` characters, for an error message that quotes what it could not use: one
    short line, whatever the input (a whole JSON file given where a vocabulary was expected, a 5,000-digit
    number).

    >>> excerpt("abc"), excerpt("x" * 200, 20), excerpt("two\\nlines", quote=False)
    ("'abc'", "'xxxxxxxxxxxxxxxx...", 'two lines')
    """
    text = repr(value) if quote else " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
