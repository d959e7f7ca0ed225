"""GGUF files for registry tests: a header written by hand (version 3, little-endian), with the metadata asked for
and a vocabulary array before it, as real files have; no tensors (the registry reads the header only)."""

from __future__ import annotations

import struct
from pathlib import Path

_UINT32, _STRING, _ARRAY, _UINT64 = 4, 8, 9, 10


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _value(value: object) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", _STRING) + _string(value)
    if isinstance(value, list):  # an array of strings
        return struct.pack("<IIQ", _ARRAY, _STRING, len(value)) + b"".join(_string(str(v)) for v in value)
    assert isinstance(value, int) and not isinstance(value, bool)
    return struct.pack("<IQ", _UINT64, value) if value >= 2**32 else struct.pack("<II", _UINT32, value)


def write_gguf(path: Path, metadata: dict[str, object], *, version: int = 3) -> Path:
    """`path`, a GGUF file whose header holds `tokenizer.ggml.tokens` (a small vocabulary) then `metadata`."""
    items = {"tokenizer.ggml.tokens": [f"<t{i}>" for i in range(300)], **metadata}
    header = b"GGUF" + struct.pack("<IQQ", version, 0, len(items))
    body = b"".join(_string(key) + _value(value) for key, value in items.items())
    path.write_bytes(header + body)
    return path


def llama_gguf(path: Path, *, chat_template: bool = True, context: int = 4096, architecture: str = "llama") -> Path:
    metadata: dict[str, object] = {"general.architecture": architecture, f"{architecture}.context_length": context,
                                   "general.name": "tiny"}
    if chat_template:
        metadata["tokenizer.chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return write_gguf(path, metadata)
