"""Writing a trial's files: a directory written atomically (readers never see a half-written one), and its
tensors brought to the host without waiting for the device, on a side stream (``copy_to_host``)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Side streams for copies to the host, one per device (created on first use; never freed: one per process).
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


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


class HostCopy:
    """Tensors on their way to host memory (``copy_to_host``): ``wait`` returns them there, each in its own storage.

    On a CUDA device the copy runs on a side stream into pinned host memory; ``wait`` waits for the event recorded
    after it (not for the device), so any thread may call it, and more than once.
    """

    def __init__(self, host: dict[str, torch.Tensor], groups: list[tuple[torch.Tensor, list[_Part]]],
                 event: torch.cuda.Event | None, names: list[str]) -> None:
        self._host = host  # tensors that were on the host (copied)
        self._groups = groups  # each: a flat pinned buffer being filled, and the tensors it holds
        self._event = event
        self._names = names

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        out = dict(self._host)
        for flat, parts in self._groups:
            for part, piece in zip(parts, flat.split([p.numel for p in parts]), strict=True):
                out[part.name] = part.restore(piece)
        return {name: out[name] for name in self._names}


@dataclass(frozen=True)
class _Part:
    """One tensor of a flat copy: its name and how its piece of the flat buffer is shaped back (``restore``)."""

    name: str
    shape: tuple[int, ...]
    transposed: bool  # copied as its transpose, which is contiguous

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def restore(self, piece: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return piece.view(self.shape[::-1]).T.contiguous()
        return piece.view(self.shape).clone()  # its own storage: safetensors saves no shared ones


def _flat(name: str, tensor: torch.Tensor) -> tuple[_Part, torch.Tensor]:
    """The tensor as a flat device tensor and how to shape it back. A transpose of a contiguous tensor (what
    AdapterStore.read clones) is read in its storage's order: a view, where flattening it would be another copy."""
    transposed = tensor.dim() == 2 and not tensor.is_contiguous() and tensor.T.is_contiguous()
    source = tensor.T if transposed else tensor
    return _Part(name, tuple(tensor.shape), transposed), source.reshape(-1)


def copy_to_host(tensors: dict[str, torch.Tensor]) -> HostCopy:
    """Start copying ``tensors`` to host memory without waiting for the device; ``HostCopy.wait`` has them.

    On a CUDA device the tensors of each dtype are gathered into one device buffer on the current stream (it holds
    their values as of now, whatever the stream does to them next), then copied into pinned host memory on a side
    stream, non-blocking: nothing here waits for the device. Host tensors are plainly copied.
    """
    names = list(tensors)
    host = {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in tensors.items() if not t.is_cuda}
    by_dtype: dict[torch.dtype, list[tuple[_Part, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if tensor.is_cuda:
            by_dtype.setdefault(tensor.dtype, []).append(_flat(name, tensor.detach()))
    if not by_dtype:
        return HostCopy(host, [], None, names)
    device = next(iter(by_dtype.values()))[0][1].device
    flats = [torch.cat([flat for _, flat in group]) for group in by_dtype.values()]
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the gathers first
    groups: list[tuple[torch.Tensor, list[_Part]]] = []
    with torch.cuda.stream(stream):
        for flat, group in zip(flats, by_dtype.values(), strict=True):
            pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # its device memory is not reused before the copy is done
            groups.append((pinned, [part for part, _ in group]))
        event = torch.cuda.Event()
        event.record(stream)
    return HostCopy(host, groups, event, names)
