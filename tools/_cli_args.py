"""Argument types the command-line tools share (argparse reports their errors as one usage line)."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0 (seconds, a fraction)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number of at least 0")
    return value


FIGURE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def figure_path(text: str) -> Path:
    """A file a figure can be written to: a suffix matplotlib writes (its folder is made when
    the figure is saved)."""
    path = Path(text)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: give a file ending in {', '.join(FIGURE_SUFFIXES)}")
    if path.exists() and path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file")
    return path


def plotting_library(name: str, purpose: str):
    """``name`` imported, or SystemExit with one line naming the install (quoted for zsh)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise SystemExit(f"error: {purpose} needs {name}: pip install -e '.[report]'") from None
