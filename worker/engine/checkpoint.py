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

from worker.engine.optim import SlotAdamW
from worker.engine.slots import SlotState
from worker.engine.store import AdapterStore, ModuleTensors
from worker.engine.trial_files import HostCopy, copy_to_host, write_dir_atomically

FORMAT = 1
TENSORS, STATE = "slot.safetensors", "slot.json"


# Where one layer's adapter sits in each rank row of a slot's row of the store (worker/engine/store.py's layout):
# (path, A's offset, d_in, B's offset, d_out).
_Place = tuple[str, int, int, int, int]
MATRICES = ("adapter", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class SlotSnapshot:
    """A slot's checkpoint as of one moment, in host memory (or on its way there: ``trial_files.copy_to_host``), not
    yet on disk.

    Taking one queues copies on the device and waits for none; ``write`` (which waits for them, cuts the rows into
    each layer's tensors and writes the files) may run on another thread while training goes on: nothing it reads
    changes.
    """

    tensors: HostCopy  # each matrix's live part of the slot's row, the best adapter, the sampler's generator
    places: list[_Place]  # where each of the trial's layers sits in a rank row
    rank: int
    rank_width: int
    info: dict[str, Any]
    trial_id: str
    step: int

    def write(self, directory: Path) -> Path:
        """Write the checkpoint to ``directory`` atomically (an older one there is replaced)."""

        def write(tmp: Path) -> None:
            save_file(self.host_tensors(), str(tmp / TENSORS))
            (tmp / STATE).write_text(json.dumps(self.info, indent=1) + "\n")

        return write_dir_atomically(Path(directory), write)

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as saved: each layer's at the trial's true rank (waits for the copy)."""
        copied = self.tensors.wait()
        out = {name: t for name, t in copied.items() if name.split("/")[0] not in MATRICES}
        for kind in MATRICES:
            rows = copied[kind].view(self.rank, self.rank_width)  # rank-major: rank row j holds A's row j, B's col j
            for path, a_offset, d_in, b_offset, d_out in self.places:
                out[f"{kind}/{path}/A"] = rows[:, a_offset:a_offset + d_in].contiguous()
                out[f"{kind}/{path}/B"] = rows[:, b_offset:b_offset + d_out].T.contiguous()
        return out


def snapshot_slot(*, slot: int, state: SlotState, store: AdapterStore, optimizer: SlotAdamW) -> SlotSnapshot:
    """Everything needed to resume ``slot`` exactly, as it is now, on its way to host memory (``SlotSnapshot.write``
    saves it). Of the adapter and the AdamW moments, the part of the slot's row its rank uses (one contiguous slice
    each: the store is rank-major) is copied whole, and cut into layers later, on the host."""
    live = store.live_columns(slot)
    tensors = {kind: matrix[slot, :live] for kind, matrix in
               zip(MATRICES, (store.weights, optimizer.exp_avg, optimizer.exp_avg_sq), strict=True)}
    if state.best is not None:
        tensors |= _flatten("best", state.best)  # replaced, never changed in place, by a better validation
    generator_state, pending = state.sampler.state()
    tensors["sampler/generator"] = generator_state
    blocks = [store.blocks[i] for i in store.targets[slot]]
    places = [(b.layer.path, b.a_offset, b.a_size, b.b_offset, b.b_size) for b in blocks]
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
    return SlotSnapshot(copy_to_host(tensors), places, store.ranks[slot], store.rank_width, info,
                        state.spec.trial_id, state.steps_done)


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
