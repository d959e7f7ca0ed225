"""A trial's exports (issue 35): its merged model, its base with its adapter merged in, as a Hugging Face safetensors
directory that `transformers` loads, and vLLM, llama.cpp's converters and Ollama users start from; and its adapter as
a llama.cpp LoRA GGUF (worker/gguf_export.py).

Built once, on request: the API sends an `ExportRequest` (Celery, the exports queue that every worker consumes
beside its own) on the first `GET .../adapter?format=merged` (or `gguf`), and answers 202 until it is in the store.
The worker records itself as the build's claimant first: should it die mid-build, the API sees its process gone and
sends the build again (common/export_builds.py).
Built on the CPU in the worker process, between its packs or beside them: merging is one matrix product per adapted
layer, and the CPU leaves the GPU's memory to the packs.

The merge is PEFT's own (`merge_and_unload`), on the base as the worker loads it for training (a GGUF base
de-quantised), in float32, then saved in the base's declared dtype: the merged model's logits equal base + adapter to
that dtype's tolerance (tests/e2e/test_trained_adapters.py).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

from common.artifacts import LocalArtifactStore, export_claimed_key, export_failure_key, export_key
from common.export_builds import BuildClaim
from common.messages import ExportRequest
from worker.engine.base_model import base_dtype, load_base_model
from worker.engine.quantize import dequantize
from worker.gguf_export import write_adapter_gguf
from worker.model_cache import model_source
from worker.pack_runner import tar_dir, untar

log = logging.getLogger(__name__)


def merge_adapter(request: ExportRequest, *, adapter_dir: Path, out_dir: Path, cache_dir: Path) -> Path:
    """Writes the merged model of ``adapter_dir`` (a PEFT adapter) on ``request.base_model`` to ``out_dir``."""
    source = model_source(request.base_model.model_dump())
    if source.quantization is None:
        model, tokenizer = load_base_model(source, cache_dir=cache_dir, device=torch.device("cpu"),
                                           dtype=torch.float32)
    else:
        # The adapter was trained against the de-quantised 4-bit weights, not the checkpoint's own (merging into
        # those is the wrong merge users of 4-bit training report): quantised from the dtype this worker's packs
        # load the base in, as they quantise it, then de-quantised, and merged in float32.
        packs_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_base_model(source, cache_dir=cache_dir, device=torch.device("cpu"),
                                           dtype=base_dtype(packs_device))
        dequantize(model)
        model.float()
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    declared = getattr(merged.config, "dtype", None) or getattr(merged.config, "torch_dtype", None)
    if isinstance(declared, torch.dtype) and declared != torch.float32:
        merged = merged.to(declared)
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def adapter_gguf(request: ExportRequest, *, adapter_dir: Path, out: Path, cache_dir: Path) -> Path:
    """Writes ``adapter_dir`` as a LoRA GGUF for ``request.base_model`` (loaded on the CPU for its config: a GGUF or
    in-memory base has no config file to read alone)."""
    source = model_source(request.base_model.model_dump())
    model, _ = load_base_model(source, cache_dir=cache_dir, device=torch.device("cpu"))
    return write_adapter_gguf(adapter_dir, model.config, out)


@dataclass(frozen=True)
class Claimant:
    """The worker process that builds: its worker id, and its incarnation (id, start) as its heartbeats carry it."""

    worker_id: str
    incarnation: str
    started_at: float


def build_export(request: ExportRequest, *, store: LocalArtifactStore, cache_dir: Path,
                 claimant: Claimant | None = None) -> None:
    """Builds the export of ``request`` and stores it at its `export_key`; a build that fails stores why at its
    `export_failure_key` (the API reports it once, and the next request tries again). ``claimant``: recorded at the
    export's `export_claimed_key` before the build starts, so that the API sends the build again should this process
    die (common/export_builds.py)."""
    out_key = export_key(request.task_id, request.trial_id, request.format)
    if store.exists(out_key):
        return  # built already (a request sent twice)
    if claimant is not None and request.request_id is not None:
        claim = BuildClaim(request_id=request.request_id, worker_id=claimant.worker_id,
                           incarnation=claimant.incarnation, started_at=claimant.started_at, at=time.time())
        store.put_bytes(export_claimed_key(request.task_id, request.trial_id, request.format), claim.to_json())
    log.info("building the %s export of trial %s (base %s)", request.format, request.trial_id,
             request.base_model.name)
    try:
        with tempfile.TemporaryDirectory(prefix="export-") as tmp_name:
            tmp = Path(tmp_name)
            adapter_dir = untar(store, request.adapter_key, tmp / "adapter")
            if request.format == "gguf":
                built = adapter_gguf(request, adapter_dir=adapter_dir, out=tmp / "adapter.gguf", cache_dir=cache_dir)
            else:
                out_dir = merge_adapter(request, adapter_dir=adapter_dir, out_dir=tmp / "merged", cache_dir=cache_dir)
                built = tar_dir(out_dir, tmp / "merged.tar.gz", gzip=True)
            store.put_file(out_key, built)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the user is told, not left polling for ever
        log.exception("the %s export of trial %s could not be built", request.format, request.trial_id)
        error = {"error": f"{type(exc).__name__}: {exc}"}
        store.put_bytes(export_failure_key(request.task_id, request.trial_id, request.format),
                        json.dumps(error).encode())
        return
    log.info("%s export of trial %s stored at %s", request.format, request.trial_id, out_key)
