"""An earlier commit checked out beside this tree, for the A/B scripts (``ab_*.py``)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def checked_out(rev: str) -> Iterator[Path]:
    """``rev`` in a temporary detached git worktree, removed (with the directory) after."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=True)
