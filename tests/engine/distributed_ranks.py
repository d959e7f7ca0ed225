"""One pack's scenario, run by `tests/engine/test_distributed.py` on one process and on each rank of two (gloo).

The scenario exercises what a pack does over its life: trials of different lengths and validation intervals (so
the ranks' passes differ), a generative metric at a trial's end, a trial stopped early with its best adapter
exported, a trial paused to a checkpoint and admitted again from it, and a back-fill admitted into a free slot.
What happens when is decided by the pack's loop iteration (each rank's loop runs the same iterations), so the two
runs see the same events at the same pack steps.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.engine.factories import TINY, chat_rows, make_spec, score
from worker.engine.base_model import load_base_model
from worker.engine.distributed import Lockstep, assign_ranks, decoder_layers, shard_base
from worker.engine.spec import Evaluation, PackConfig, TrialOutcome, TrialSpec
from worker.engine.trainer import PackCallbacks, StopMode, train_pack

CAPACITY = 3  # slots of each rank's engine; the one-process engine has room for every trial
EXPORT_AT, PAUSE_AT, RESUME_FROM, BACKFILL_AT = 7, 5, 9, 3  # loop iterations


def specs() -> dict[str, TrialSpec]:
    return {
        "a": make_spec("a", max_steps=10, seed=1, eval_interval=4,
                       evaluation=Evaluation(metric="exact_match", max_new_tokens=6)),
        "b": make_spec("b", max_steps=12, seed=2, eval_interval=5),
        "c": make_spec("c", max_steps=6, seed=3, eval_interval=3, val_rows=chat_rows(6), batch_size=2,
                       lora_rank=8, target_modules=["all-linear"]),
        "d": make_spec("d", max_steps=8, seed=4, eval_interval=2, lora_rank=2,
                       evaluation=Evaluation(metric="contains", max_new_tokens=4)),
        "e": make_spec("e", max_steps=9, seed=5, eval_interval=3),
    }


def rank_of(trial_id: str, world: int) -> int:
    """Where each trial trains: the pack's starting trials dealt in turn, the back-fill d and b's resumption on
    the last rank (a back-fill goes to a rank with a free slot)."""
    if trial_id in ("b", "d"):
        return world - 1
    order = ["a", "c", "e"]
    return next(r for r, ids in enumerate(assign_ranks(order, world)) if trial_id in ids)


def run(rank: int, world: int, out: str, store: str, cache: str, backend: str = "gloo") -> None:
    """The scenario on ``rank`` of ``world`` processes (``world`` 1: alone, with every trial); writes this rank's
    outcomes and points to ``out/rank<rank>.json`` and its adapters under ``out/export<rank>/``. ``backend``
    ``gloo``: on the CPU in fp32; ``nccl``: rank r on GPU r, the base in bf16 as the service runs it."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        # A collective the ranks disagree on fails after the timeout instead of hanging the suite.
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120), device_id=device if device.type == "cuda" else None)
    try:
        _run(rank, world, Path(out), Path(cache), device)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run(rank: int, world: int, out: Path, cache: Path, device: torch.device) -> None:
    model, tokenizer = load_base_model(TINY, cache_dir=cache, device=device)
    lockstep = None
    if world > 1:
        shard_base(model)
        lockstep = Lockstep()
    all_specs = specs()
    mine = [all_specs[t] for t in ("a", "b", "c", "e") if rank_of(t, world) == rank]
    points: list[list[Any]] = []
    steps: list[list[int]] = []  # each pack step as on_step sees it: the whole pack's, over every rank
    checkpoints: dict[str, Path] = {}
    iteration = {"n": 0}
    admitted: set[str] = set()

    def should_stop() -> dict[str, StopMode]:
        iteration["n"] += 1
        n = iteration["n"]
        stops: dict[str, StopMode] = {}
        if n == EXPORT_AT:
            stops["e"] = "export"
        if n == PAUSE_AT:
            stops["b"] = "pause"
        return stops

    def admissions(free: int) -> list[tuple[TrialSpec, Path | None]]:
        n = iteration["n"]
        due = []
        if n >= BACKFILL_AT and rank_of("d", world) == rank:
            due.append(("d", None))
        if n >= RESUME_FROM and "b" in checkpoints and rank_of("b", world) == rank:
            due.append(("b", checkpoints["b"]))
        given = [(all_specs[t], path) for t, path in due if t not in admitted][:free]
        admitted.update(spec.trial_id for spec, _ in given)
        return given

    outcomes = train_pack(
        model, tokenizer, mine,
        PackConfig(base_model_name="tiny-random-llama", export_dir=out / f"export{rank}",
                   checkpoint_dir=out / f"checkpoints{rank}",  # pauses only
                   capacity=CAPACITY if world > 1 else 2 * CAPACITY, max_rank=4),
        PackCallbacks(on_point=lambda *p: points.append(list(p)), should_stop=should_stop,
                      on_step=lambda stats: steps.append([stats.active_slots, stats.tokens, stats.target_tokens]),
                      on_checkpoint=lambda trial_id, step, path: checkpoints.setdefault(trial_id, path),
                      admissions=admissions, score=score),
        lockstep=lockstep,
    )  # fmt: skip
    result = {"outcomes": [_outcome(o) for o in outcomes], "points": points, "steps": steps,
              "idle": lockstep.idle if lockstep is not None else None, "layer_share": _layer_share(model)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _layer_share(model: torch.nn.Module) -> float:
    """The share of the decoder layers' weights this rank holds (1/world when they are sharded)."""
    held = total = 0
    for p in decoder_layers(model).parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        held, total = held + local.numel(), total + p.numel()
    return held / total


def _outcome(o: TrialOutcome) -> dict[str, Any]:
    return {"trial_id": o.trial_id, "status": o.status, "steps_done": o.steps_done, "best_val_loss": o.best_val_loss,
            "best_step": o.best_step, "adapter_dir": str(o.adapter_dir) if o.adapter_dir else None, "error": o.error}


def fused_forwards(rank: int, world: int, store: str, cache: str) -> None:
    """On ``rank`` of ``world`` (gloo): the forwards ``fuse`` sets, run in layers sharded by FSDP2, give the
    unsharded model's logits and input gradients. Torch functions stand in for Liger's Triton kernels (the same
    signatures): a forward that kept a module's weight from fuse time would hand the kernel the sharded DTensor."""
    import torch.nn.functional as F

    from worker.engine.fused import FUSED_OPS, FusedKernels, fuse, unfuse

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model, _ = load_base_model(TINY, cache_dir=Path(cache), device=torch.device("cpu"))
        ids = torch.tensor([[5, 9, 14, 3, 7, 21, 30, 2]])

        def logits_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds).logits
            logits.float().square().mean().backward()
            assert embeds.grad is not None
            return logits.detach(), embeds.grad

        expected = logits_and_grad()
        shard_base(model)
        family = sys.modules[type(model).__module__]

        def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *_: Any) -> torch.Tensor:
            assert not isinstance(weight, DTensor), "the fused RMSNorm was handed the sharded weight"
            return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        kernels = FusedKernels(rms_norm=rms_norm, swiglu=lambda gate, up: F.silu(gate) * up,
                               rope=family.apply_rotary_pos_emb)
        assert fuse(model, FUSED_OPS, kernels) == list(FUSED_OPS)
        for _ in range(2):  # the second pass runs on weights FSDP2 freed after the first and gathered again
            got = logits_and_grad()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        unfuse(model)
    finally:
        dist.destroy_process_group()
