"""A digest of autosp's own sources, for what is kept on disk and must not outlive the code that made it:
inductor's FX graph cache keys autosp's custom ops by name only (ir/inductor.py), and a kept plan indexes a
joint program that autosp's passes derive (remat/store.py)."""
from __future__ import annotations

import functools
import hashlib
import pathlib


@functools.cache
def digest() -> str:
    """sha256 over every .py file of the autosp package, with its path."""
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()
