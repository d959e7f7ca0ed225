"""A registered model's tokenizer, as the API counts tokens with it (common/token_lengths.py): built with `tokenizers`
from the files the worker loads, without torch or transformers.

- the synthetic `tiny-random-llama`: its one definition, common/tiny_tokenizer.py;
- `hf` directories: tokenizer.json, and the chat template and special tokens of tokenizer_config.json (or
  chat_template.jinja, special_tokens_map.json);
- GGUF files (`gguf`, `gguf-package`) of a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2", as SmolLM2):
  the tokens, merges and token types of the header, built as transformers' GGUF converter builds them
  (transformers/integrations/gguf/gguf_tokenizer_mapping.py `byte_level_tokenizer`, `add_gguf_special_tokens`,
  `set_split_regex`).

Where no tokenizer can be built here (a directory with only a sentencepiece tokenizer.model, a GGUF of another
vocabulary type), `load_tokenizer` answers None and the lengths go unchecked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import struct
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from common.architectures import GGUF_MAGIC, _GgufReader
from common.tiny_tokenizer import TINY_TOKENIZER, bytes_to_unicode
from common.token_lengths import ChatTokenizer

# Changes when the counting changes: lengths stored under an older fingerprint are counted again.
COUNTING_VERSION = "1"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def load_tokenizer(kind: str, path: str | None, package: str | None, gguf_file: str | None) -> ChatTokenizer | None:
    """The tokenizer of a registry entry's source fields, or None where it cannot be built here (or its files are
    missing). Built once per files' revision (their sizes and modification times) and kept."""
    if kind == "tiny-random-llama":
        return _tiny()
    files = _source_files(kind, path, package, gguf_file)
    if not files:
        return None
    revision = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _load(kind, revision)


def _source_files(kind: str, path: str | None, package: str | None, gguf_file: str | None) -> list[Path]:
    if kind == "hf":
        folder = Path(path) if path else None
        if folder is None or not (folder / "tokenizer.json").is_file():
            return []
        return [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    if kind == "gguf" and path and gguf_file:
        return [Path(path) / gguf_file] if (Path(path) / gguf_file).is_file() else []
    if kind == "gguf-package" and package and gguf_file:
        spec = importlib.util.find_spec(package)  # located, never imported (as worker/engine/base_model.py)
        if spec is None or not spec.submodule_search_locations:
            return []
        file = Path(list(spec.submodule_search_locations)[0]) / gguf_file
        return [file] if file.is_file() else []
    return []


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(repr((COUNTING_VERSION, *parts)).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _tiny() -> ChatTokenizer:
    recipe = TINY_TOKENIZER
    backend = recipe.build()
    return ChatTokenizer(backend=backend, chat_template=recipe.chat_template,
                         special_tokens={"eos_token": recipe.eos_token, "pad_token": recipe.pad_token},
                         eos_token_id=backend.token_to_id(recipe.eos_token), fingerprint=_fingerprint(recipe))


@lru_cache(maxsize=8)
def _load(kind: str, revision: tuple[tuple[str, int, int], ...]) -> ChatTokenizer | None:
    files = [Path(name) for name, _, _ in revision]
    if kind == "hf":
        return _hf_tokenizer(files[0].parent, _fingerprint(revision))
    return _gguf_tokenizer(files[0], _fingerprint(revision))


# ---- Hugging Face directories -----------------------------------------------------------------------------------

def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's template (a string, or named ones: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _hf_tokenizer(folder: Path, fingerprint: str) -> ChatTokenizer | None:
    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a tokenizer.json this version cannot read: lengths go unchecked
        return None
    config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
    special = {name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None}
    return _with_pad(backend, _chat_template(folder, config), special, fingerprint)


def _with_pad(backend: Tokenizer, template: str | None, special: dict[str, str], fingerprint: str) -> ChatTokenizer:
    """The worker's tokenizer pads with eos where it has no pad token (`load_base_model`)."""
    if "pad_token" not in special and "eos_token" in special:
        special["pad_token"] = special["eos_token"]
    eos = special.get("eos_token")
    return ChatTokenizer(backend=backend, chat_template=template, special_tokens=special,
                         eos_token_id=backend.token_to_id(eos) if eos is not None else None, fingerprint=fingerprint)


# ---- GGUF files -------------------------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# The split regexes of the pre-tokenizer types with one (tokenizer.ggml.pre), transformers' GGUF_PRE_TOKENIZER_SPLITS.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_KEPT = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.tokens",
         "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer's keys of a GGUF header: strings, scalars and the token, merge and token-type arrays."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:len(GGUF_MAGIC)] != GGUF_MAGIC:
            raise ValueError("not a GGUF file")
        reader = _GgufReader(buf)
        reader.pos = len(GGUF_MAGIC)
        if reader.scalar("<I") not in (2, 3):
            raise ValueError("unsupported GGUF version")
        reader.scalar("<Q")
        out: dict[str, Any] = {}
        for _ in range(reader.scalar("<Q")):
            key = reader.string(keep=True)
            kind = reader.scalar("<I")
            if key in _KEPT and kind == 9:
                out[key] = _array(reader)
            else:
                out[str(key)] = reader.value(kind, keep=key in _KEPT)
        return out


def _array(reader: _GgufReader) -> list[Any]:
    item, count = reader.scalar("<I"), reader.scalar("<Q")
    if item == 8:
        return [reader.string(keep=True) for _ in range(count)]
    fmt = {4: "<I", 5: "<i"}.get(item)
    if fmt is None:
        raise ValueError(f"unexpected GGUF array type {item}")
    values = list(struct.unpack_from(f"<{count}{fmt[1]}", reader.buf, reader.pos))
    reader.skip(count * 4)
    return values


def _gguf_tokenizer(path: Path, fingerprint: str) -> ChatTokenizer | None:
    try:
        meta = _gguf_metadata(path)
    except (OSError, ValueError, struct.error):
        return None
    if meta.get("tokenizer.ggml.model") != "gpt2" or not meta.get("tokenizer.ggml.tokens"):
        return None  # a sentencepiece or unigram vocabulary: not built here
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre") or "")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    backend.pre_tokenizer = (byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]))
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=False))  # a file may give no token types
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in typed
                                if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in typed
                        if k == _USER_DEFINED and t in vocab])
    ids = ("bos", "eos", "unknown", "padding")
    special = {name: tokens[i] for name, key in zip(_SPECIAL_NAMES, ids, strict=True)
               if isinstance(i := meta.get(f"tokenizer.ggml.{key}_token_id"), int) and 0 <= i < len(tokens)}
    _add_bos_eos(backend, meta, special)
    return _with_pad(backend, meta.get("tokenizer.chat_template") or None, special, fingerprint)


def _add_bos_eos(backend: Tokenizer, meta: Mapping[str, Any], special: Mapping[str, str]) -> None:
    """tokenizer.ggml.add_bos_token / add_eos_token: the specials an encode with them adds."""
    pre = [special["bos_token"]] if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in special else []
    post = [special["eos_token"]] if meta.get("tokenizer.ggml.add_eos_token") and "eos_token" in special else []
    if not pre and not post:
        return
    ids = {t: backend.token_to_id(t) for t in {*pre, *post}}
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*pre, "$A", *post]), special_tokens=[(t, i) for t, i in ids.items() if i is not None])
