"""The cache folder (`PAGODA_CACHE_DIR`, else ~/.cache/pagoda) and writing model folders into
it: atomically (a temporary folder renamed), readable by every user, so whoever wrote a
folder need not be the user who serves it. Used for the bundled model's float conversion
(engine/default_model.py) and GGUF files' metadata folders (engine/gguf/folder.py)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    ))


def make_readable(root: Path) -> None:
    """Folders 0755 and files 0644 from `root` down, whatever the umask: a model folder
    written by one user (or by root at build time) can be served by another, non-root one.
    Symbolic links are left alone (chmod would follow them out of the folder)."""
    os.chmod(root, 0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)


def _make_dirs(folder: Path) -> None:
    """`mkdir -p folder`, the folders it creates 0755 whatever the umask."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # another process made it meanwhile: its folder, its mode
            continue
        os.chmod(path, 0o755)


def write_folder(target: Path, write: Callable[[Path], None], what: str, verbose: bool = True) -> None:
    """`write(folder)` into a temporary folder beside `target`, then rename it to `target`, so a
    crash never leaves half a model; the result is readable by every user."""
    if verbose:
        print(f"[pagoda] {what} -> {target} (once) ...", file=sys.stderr, flush=True)
    _make_dirs(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        write(tmp)
        # mkdtemp's folder is 0700, and the files follow the umask: readable by all before
        # the rename, so the folder never appears unreadable to other users.
        make_readable(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"[pagoda] ready: {target}", file=sys.stderr, flush=True)
