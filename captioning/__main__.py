"""``python -m captioning`` is the ``captioning`` command."""

import sys

from captioning.cli import main

if __name__ == "__main__":
    sys.exit(main())
