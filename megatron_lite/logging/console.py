"""Console output that several processes share."""

import sys
from typing import TextIO


def emit_line(text: str, file: TextIO | None = None) -> None:
    """Write ``text`` and its newline in one write, then flush.

    ``print`` writes the text and the newline separately; with unbuffered output
    (``PYTHONUNBUFFERED=1``, common in batch job scripts) those are two writes to a pipe that
    every rank shares, and another rank's line can land between them. One write of a line under
    the pipe's atomic size (4 KiB on Linux) is never split.
    """
    out = file if file is not None else sys.stdout
    out.write(text + "\n")
    out.flush()
