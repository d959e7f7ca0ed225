"""Checkpoint one slot to a directory and resume it exactly (``slot.safetensors`` + ``slot.json``).

Everything a trial's future depends on is saved: its adapter, AdamW moments and step count, its data
cursor (sampler generator state and drawn-but-unused rows), its progress and best-validation state. The
LR-schedule position is its step count, and dropout masks are a hash of (seed, step, position), so there
is no other RNG state. Tensors are saved per layer at the trial's true rank, so a checkpoint resumes into
any pack whose layers cover the trial's, whatever its capacity, slot or max rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from worker.engine.files import to_host, write_dir_atomically
from worker.engine.optim import SlotAdamW
from worker.engine.slots import SlotState
from worker.engine.store import AdapterStore, ModuleTensors

FORMAT = 1
TENSORS, STATE = "slot.safetensors", "slot.json"


@dataclass(frozen=True)
class SlotSnapshot:
    """A slot's checkpoint as of one moment: device clones of its tensors and its state, not yet on disk.

    Taking one is cheap device work on the training thread; ``write`` (the copy to the host and the files)
    may run on another thread while training goes on: nothing it reads changes.
    """

    tensors: dict[str, torch.Tensor]
    info: dict[str, Any]

    def write(self, directory: Path) -> Path:
        """Write the checkpoint to ``directory`` atomically (an older one there is replaced)."""

        def write(tmp: Path) -> None:
            save_file(to_host(self.tensors), str(tmp / TENSORS))
            (tmp / STATE).write_text(json.dumps(self.info, indent=1) + "\n")

        return write_dir_atomically(Path(directory), write)


def snapshot_slot(*, slot: int, state: SlotState, store: AdapterStore, optimizer: SlotAdamW) -> SlotSnapshot:
    """Everything needed to resume ``slot`` exactly, as it is now (``SlotSnapshot.write`` saves it)."""
    tensors: dict[str, torch.Tensor] = {}
    matrices = {"adapter": store.weights, "exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq}
    for kind, matrix in matrices.items():
        tensors |= _flatten(kind, store.read(matrix, slot))
    if state.best is not None:
        tensors |= _flatten("best", state.best)  # replaced, never changed in place, by a better validation
    generator_state, pending = state.sampler.state()
    tensors["sampler/generator"] = generator_state
    spec = {k: v for k, v in dataclasses.asdict(state.spec).items() if k not in ("train_rows", "val_rows")}
    info: dict[str, Any] = {
        "format": FORMAT,
        "fingerprint": _fingerprint(state),
        "spec": spec,
        "steps_done": state.steps_done,
        "optimizer_steps": optimizer.steps[slot],
        "last_train_loss": state.last_train_loss,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "sampler_pending": pending,
    }
    return SlotSnapshot(tensors, info)


def save_slot(directory: Path, *, slot: int, state: SlotState, store: AdapterStore, optimizer: SlotAdamW) -> Path:
    """Write ``slot``'s checkpoint to ``directory`` atomically (an older one there is replaced)."""
    return snapshot_slot(slot=slot, state=state, store=store, optimizer=optimizer).write(directory)


def load_slot(directory: Path, *, slot: int, state: SlotState, store: AdapterStore, optimizer: SlotAdamW) -> None:
    """Resume ``slot`` (freshly admitted with the same trial) from the checkpoint in ``directory``.

    Raises:
        ValueError: a checkpoint of another format or of a differently configured trial.
    """
    info = json.loads((Path(directory) / STATE).read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{directory}: checkpoint format {info.get('format')!r}, want {FORMAT}")
    expected = _fingerprint(state)
    differences = {k: (info["fingerprint"].get(k), v) for k, v in expected.items() if info["fingerprint"].get(k) != v}
    if differences:
        raise ValueError(f"{directory}: checkpoint of a different configuration (saved, now): {differences}")
    tensors = load_file(str(Path(directory) / TENSORS), device=str(store.weights.device))
    config = state.config
    store.load_slot(slot, _unflatten(tensors, "adapter"), rank=config.rank, scale=config.scale)
    store.write(optimizer.exp_avg, slot, _unflatten(tensors, "exp_avg"))
    store.write(optimizer.exp_avg_sq, slot, _unflatten(tensors, "exp_avg_sq"))
    optimizer.steps[slot] = int(info["optimizer_steps"])
    state.sampler.load_state(tensors["sampler/generator"].cpu(), [int(i) for i in info["sampler_pending"]])
    state.steps_done = int(info["steps_done"])
    state.last_train_loss = info["last_train_loss"]
    state.best_val_loss, state.best_step = info["best_val_loss"], info["best_step"]
    best = _unflatten(tensors, "best")
    state.best = best or None


def _fingerprint(state: SlotState) -> dict[str, Any]:
    """What must match for a checkpoint to continue this trial: the tensors' layout and the data stream."""
    spec = state.spec
    return {
        "trial_id": spec.trial_id,
        "lora_rank": spec.lora_rank,
        "target_paths": state.paths,
        "seed": spec.seed,
        "batch_size": spec.batch_size,
        "train_examples": len(state.train),
    }


def _flatten(kind: str, tensors: ModuleTensors) -> dict[str, torch.Tensor]:
    out = {}
    for path, (lora_a, lora_b) in tensors.items():
        out[f"{kind}/{path}/A"], out[f"{kind}/{path}/B"] = lora_a, lora_b
    return out


def _unflatten(tensors: dict[str, torch.Tensor], kind: str) -> ModuleTensors:
    out = {}
    for key, lora_a in tensors.items():
        if key.startswith(f"{kind}/") and key.endswith("/A"):
            path = key[len(kind) + 1 : -2]
            out[path] = (lora_a, tensors[f"{kind}/{path}/B"])
    return out
