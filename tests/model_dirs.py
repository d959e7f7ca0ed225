"""Real Hugging Face model directories for registry tests: the tiny random Llama that workers materialise
(LlamaConfig, safetensors weights, a byte-level tokenizer with a chat template), and broken variants of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from worker.engine.models import materialize_tiny_llama


def tiny_llama_dir(path: Path) -> Path:
    """`path`, holding config.json (model_type llama), model.safetensors and tokenizer.json."""
    return materialize_tiny_llama(path)


def copy_without(source: Path, target: Path, *names: str) -> Path:
    """A copy of the model directory `source` at `target` lacking the files `names`."""
    shutil.copytree(source, target)
    for name in names:
        (target / name).unlink()
    return target


def with_config(source: Path, target: Path, **changes: object) -> Path:
    """A copy of `source` at `target` whose config.json has `changes` applied."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target
