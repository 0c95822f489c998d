"""``python -m stepgraph.serve --model PRESET|DIR ...``: the same as ``stepgraph serve``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
