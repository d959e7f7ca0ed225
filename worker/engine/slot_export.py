"""What a slot's state leaves the engine as: a checkpoint to resume the trial from exactly (adapter, AdamW state,
data cursor, best-validation state: checkpoint.py) and its best adapter in PEFT format (export.py). Each comes in
two halves, so that the training thread only snapshots and a writer thread writes (worker/engine/writer.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from worker.engine import checkpoint as checkpoints
from worker.engine.export import PeftFiles, flat_peft_tensors, peft_files
from worker.engine.lora import peft_target_modules
from worker.engine.pack_engine import PackEngine
from worker.engine.trial_files import copy_to_host


def checkpoint(engine: PackEngine, slot: int, directory: Path) -> Path:
    """Save everything needed to resume the slot exactly (``engine.admit(spec, resume=directory)``)."""
    return prepare_checkpoint(engine, slot, directory)()


def prepare_checkpoint(engine: PackEngine, slot: int, directory: Path) -> Callable[[], Path]:
    """``checkpoint`` in two halves: this call snapshots the slot now (device clones); the function it
    returns writes that snapshot to ``directory`` and may run later, on another thread."""
    state, store, optimizer = engine.state(slot), engine.store, engine.optimizer
    snapshot = checkpoints.snapshot_slot(slot=slot, state=state, store=store, optimizer=optimizer)
    return lambda: snapshot.write(directory)


def export(engine: PackEngine, slot: int, directory: Path, *, base_model_name: str) -> Path:
    """Write the slot's best-validation adapter (the current one if it has none) in PEFT format."""
    return prepare_export(engine, slot, directory, base_model_name=base_model_name)()


def prepare_export(engine: PackEngine, slot: int, directory: Path, *, base_model_name: str) -> Callable[[], Path]:
    """``export`` in two halves, as ``prepare_checkpoint`` (``prepare_files``, then the files written to
    ``directory``)."""
    files = prepare_files(engine, slot, base_model_name=base_model_name)
    return lambda: files().write_dir(directory)


def prepare_files(engine: PackEngine, slot: int, *, base_model_name: str,
                  current: bool = False) -> Callable[[], PeftFiles]:
    """The slot's best-validation adapter (the current one if it has none; with ``current``: the adapter as it is now,
    an adapter checkpoint) as PEFT files in memory, in two halves: what they hold is fixed now (its copy to host
    memory started without waiting for the device), the function returned waits for that copy alone, not for every
    step queued since, and may run on another thread."""
    state = engine.state(slot)
    tensors = state.best if state.best is not None and not current else engine.adapter(slot)
    shapes, flat = flat_peft_tensors(tensors)
    copy = copy_to_host({"flat": flat})
    config, targets = state.config, peft_target_modules(engine.model, state.paths)

    def files() -> PeftFiles:
        return peft_files(shapes, copy.wait()["flat"], config=config, target_modules=targets,
                          base_model_name=base_model_name)

    return files
