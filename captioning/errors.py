"""Errors that the command line turns into one clear line instead of a traceback.

`InputError` means the user gave something we cannot use (a missing file, malformed JSON, an unknown
option value). The command line prints ``captioning <command>: error: <message>`` on stderr and exits
with code 2, the Unix convention for usage errors (argparse uses it too). Anything else that escapes is a
bug and keeps its traceback.
"""


class InputError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2


class DiskFullError(InputError):
    """An output could not be written because the disk (or a quota, or the process's file-size limit) is
    full: one line naming the path and what to free, exit code 1 (the input itself was fine)."""

    exit_code = 1


class PeerLostError(InputError):
    """A worker of a multi-worker cluster is gone, or never came: one line naming it, exit code 1."""

    exit_code = 1
