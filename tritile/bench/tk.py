"""TileKernels as a live anchor (``python -m tritile bench --against tilekernels``): the real ``tile_kernels``, its
ops found by the same dotted paths as tritile's (:func:`tritile.bench.resolve`), and the commits both were run at.

The import shim that runs TileKernels' tests against tritile (``tools/tk_native/shim``) also answers to
``tile_kernels``, with its kernel modules mapped onto tritile's: there ``tile_kernels.quant.__name__`` starts with
``tritile``, and it does not count as TileKernels."""

from __future__ import annotations

import importlib
import os
import subprocess
from typing import Any, Dict, Optional, Tuple

from . import Resolver, resolver


def _git_head(path: str, short: bool = False) -> Optional[str]:
    try:
        r = subprocess.run(["git", "-C", path, "rev-parse", *(["--short"] if short else []), "HEAD"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def tritile_commit() -> Optional[str]:
    """The commit being measured: ``$TRITILE_COMMIT``, else the checkout's HEAD (None outside a git checkout)."""
    return os.environ.get("TRITILE_COMMIT") or _git_head(os.path.dirname(os.path.abspath(__file__)), short=True)


def find_tilekernels(commit: Optional[str] = None) -> Tuple[Optional[Resolver], Dict[str, Any]]:
    """``(get, info)``: ``get(path)`` over the real ``tile_kernels`` and ``info["source"] == "live"``, or ``(None,
    info)`` with ``info["source"] == "recorded"`` and ``info["reason"]`` when it is missing, fails to import, or is the
    shim.  ``info["commit"]``: ``commit``, else ``$TILEKERNELS_COMMIT``, else the HEAD of the git checkout it was
    imported from (None when unknown)."""
    info: Dict[str, Any] = dict(source="recorded")
    try:
        tk = importlib.import_module("tile_kernels")
        quant = importlib.import_module("tile_kernels.quant")
    except Exception as e:  # missing, or TileLang fails to load (no CUDA, wrong wheels): the recorded figures serve
        info["reason"] = f"tile_kernels is not importable ({type(e).__name__}: {str(e)[:160]})"
        return None, info
    if quant.__name__.startswith("tritile"):
        info["reason"] = "tile_kernels is the import shim onto tritile, not TileKernels"
        return None, info
    path = os.path.dirname(os.path.abspath(tk.__file__))
    info.update(source="live", path=path,
                commit=commit or os.environ.get("TILEKERNELS_COMMIT") or _git_head(os.path.dirname(path)))
    return resolver("tile_kernels"), info
