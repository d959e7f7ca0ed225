"""Write a directory atomically: readers never see a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temp dir next to ``out_dir``, then rename it into place.

    An existing ``out_dir`` (an older checkpoint, a redelivered task's adapter) is replaced. Returns
    ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        if out_dir.exists():
            # A directory cannot be renamed onto a non-empty one: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
