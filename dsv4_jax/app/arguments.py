"""Argument types of the command line and the benchmarks: each turns one
option's text into its value or raises argparse.ArgumentTypeError with one
line saying what was expected, so that a mistaken command stops before any
work (an output path is checked before the run, not after it)."""
from __future__ import annotations

import argparse
import math
import os


def _int_at_least(minimum: int, expected: str):
    """A parser of an integer >= `minimum` (`expected` names it in errors)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonnegative_int = _int_at_least(0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def size(text: str) -> int:
    """A positive count; a "k" suffix multiplies by 1024 ("4k" = 4096)."""
    try:
        value = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (or 4k, 64k), "
                                         f"got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def sizes(text: str) -> list[int]:
    """Comma-separated sizes: "1,8,4k"."""
    return [size(v) for v in text.split(",") if v]


def names(allowed):
    """A parser of comma-separated names among `allowed`."""
    def parse(text: str) -> list[str]:
        got = [v for v in text.split(",") if v]
        bad = [v for v in got if v not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"expected names among {', '.join(allowed)}; "
                                             f"got {text!r}")
        return got
    return parse


def output_path(text: str) -> str:
    """A file this process can create or overwrite: its folder exists and is
    writable, and the path is not a folder. Checked when the options are
    read, so a run that would end unable to save its numbers never starts."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text}: is a folder, expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path)
                                                    and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable here")
    return text


def input_path(text: str) -> str:
    """A file that exists and can be read (a saved run to print)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text
