"""Writing a trial's files: a directory written atomically (readers never see a half-written one), and its
tensors brought to the host in one device copy."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


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


def to_host(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` on the host (contiguous, cast to ``dtype`` when given) with one device copy per dtype.

    A copy to pageable host memory waits for everything queued on the device before it: called per tensor
    from a writer thread while training queues steps, a checkpoint of a few hundred tensors waited a few
    hundred times.
    """
    detached = {name: t.detach() if dtype is None else t.detach().to(dtype) for name, t in tensors.items()}
    groups: dict[torch.dtype, list[str]] = {}
    for name, tensor in detached.items():
        groups.setdefault(tensor.dtype, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        flat = torch.cat([detached[name].reshape(-1) for name in names]).cpu()
        for name, part in zip(names, flat.split([detached[name].numel() for name in names]), strict=True):
            out[name] = part.view(detached[name].shape).clone()  # its own storage: safetensors saves no shared ones
    return {name: out[name] for name in tensors}
