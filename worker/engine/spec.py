"""What a trial asks for (``TrialSpec``), what a pack of them asks for besides (``PackConfig``) and how a trial
ended (``TrialOutcome``)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.engine.schedule import LR_SCHEDULES

if TYPE_CHECKING:
    from worker.engine.export import PeftFiles


@dataclass(frozen=True)
class Evaluation:
    """A generative metric the trial is scored by at its end (common/metrics.py); None on a spec: the loss."""

    metric: str  # one of common.metrics.GENERATIVE_METRICS
    max_new_tokens: int = 32
    pattern: str | None = None  # the regex metric's


@dataclass(frozen=True)
class DpoObjective:
    """A trial trained by Direct Preference Optimisation on preference rows (worker/engine/dpo.py) instead of the
    next-token loss; None on a spec: supervised fine-tuning."""

    beta: float  # the strength of the pull towards the reference (the frozen base): the implicit reward's scale
    loss: str = "sigmoid"  # one of DPO_LOSSES
    label_smoothing: float = 0.0  # the sigmoid loss's: the assumed share of pairs whose preference is flipped


DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class TrialSpec:
    """One hyperparameter configuration and its data. Rows are raw JSONL rows (chat or prompt/completion)."""

    trial_id: str
    learning_rate: float
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    batch_size: int
    target_modules: list[str]  # PEFT-style suffixes, or ["all-linear"] (every linear but lm_head)
    seed: int
    max_steps: int  # optimizer steps
    max_seq_len: int
    eval_interval: int  # validate every N steps and always at the last step
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]  # empty: no validation, the final adapter is exported
    weight_decay: float = 0.0  # decoupled, as torch.optim.AdamW
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # "constant" | "linear" | "cosine", after warm-up
    use_rslora: bool = False  # scale alpha/sqrt(r) instead of alpha/r
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = None  # clip by this trial's own global gradient norm
    # Also validate after these steps (the scheduler's early-exit warm-up boundary, which a ranking needs).
    extra_eval_steps: tuple[int, ...] = ()
    evaluation: Evaluation | None = None  # a generative metric, scored on the validation rows at the end
    # Export the adapter as it is at each epoch's end and at the last step, with the best adapter when it is older
    # and not exported yet (``PackCallbacks.on_adapter_checkpoint``): the checkpoints a user downloads.
    adapter_checkpoints: bool = False
    # Rows are preference rows ({"prompt"|"messages", "chosen", "rejected"}) trained by DPO (None: SFT rows).
    dpo: DpoObjective | None = None


@dataclass(frozen=True)
class PackConfig:
    """What a pack asks for besides its trials (``train_pack``): where its adapters and checkpoints go, and the room
    its engine makes for back-fills."""

    base_model_name: str  # what an exported adapter names as its base (``base_model_name_or_path``)
    export_dir: Path  # each trial's exported adapter goes to export_dir/<trial_id>/
    # The training trials are snapshotted every checkpoint_interval_s (0: each step; None: on a pause only) and
    # written to checkpoint_dir/<trial_id>/ (None: no checkpoint, a paused trial's included).
    checkpoint_dir: Path | None = None
    checkpoint_interval_s: float | None = None
    capacity: int | None = None  # the engine's slots (None: one per trial it starts with)
    max_rank: int | None = None  # the rank its slots are padded to (None: the trials' largest)
    target_modules: list[str] | None = None  # layers it wraps beyond the trials' own (PEFT patterns)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward (PackEngine)


@dataclass
class TrialOutcome:
    """How a trial ended. ``adapter_dir`` (completed trials, and trials stopped with an export) holds its
    best-validation adapter."""

    trial_id: str
    status: str  # "completed" | "stopped" | "paused" (checkpointed, to resume elsewhere) | "failed"
    steps_done: int
    best_val_loss: float | None
    best_step: int | None
    final_train_loss: float | None
    adapter_dir: Path | None
    error: str | None = None
    pack_steps: int = 0  # optimizer steps it took in this pack
    pack_tokens: int = 0  # real training tokens of those steps


@dataclass(frozen=True)
class AdapterCheckpoint:
    """A trial's adapter at ``step`` (``TrialSpec.adapter_checkpoints``): its PEFT files, in memory."""

    trial_id: str
    step: int
    steps_per_epoch: int
    val_loss: float | None  # None: not validated at this step
    best_step: int | None  # the trial's best validation so far (this step when it just beat it)
    files: PeftFiles

    @property
    def epoch(self) -> float:
        return round(self.step / self.steps_per_epoch, 4)

    def ends_epoch(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0


def validate_spec(spec: TrialSpec) -> None:
    """Raise ``ValueError`` listing every out-of-range field of ``spec``."""
    problems = []
    if not spec.trial_id or "/" in spec.trial_id or "\\" in spec.trial_id or spec.trial_id.startswith("."):
        problems.append(f"trial_id {spec.trial_id!r} is not a safe directory name")
    if spec.lora_rank < 1:
        problems.append(f"lora_rank {spec.lora_rank} < 1")
    if not 0.0 <= spec.lora_dropout < 1.0:
        problems.append(f"lora_dropout {spec.lora_dropout} outside [0, 1)")
    if not spec.learning_rate > 0.0:
        problems.append(f"learning_rate {spec.learning_rate} <= 0")
    for name in ("batch_size", "max_steps", "eval_interval"):
        if getattr(spec, name) < 1:
            problems.append(f"{name} {getattr(spec, name)} < 1")
    if spec.max_seq_len < 2:  # one token has nothing before it to be predicted from
        problems.append(f"max_seq_len {spec.max_seq_len} < 2")
    if spec.warmup_steps < 0:
        problems.append(f"warmup_steps {spec.warmup_steps} < 0")
    if spec.lr_schedule not in LR_SCHEDULES:
        problems.append(f"lr_schedule {spec.lr_schedule!r} not in {LR_SCHEDULES}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(spec, name) < 1.0:
            problems.append(f"{name} {getattr(spec, name)} outside [0, 1)")
    if not spec.eps > 0.0:
        problems.append(f"eps {spec.eps} <= 0")
    if not spec.weight_decay >= 0.0:
        problems.append(f"weight_decay {spec.weight_decay} < 0")
    if spec.max_grad_norm is not None and not spec.max_grad_norm > 0.0:
        problems.append(f"max_grad_norm {spec.max_grad_norm} <= 0")
    if spec.dpo is not None:
        if not spec.dpo.beta > 0.0:
            problems.append(f"dpo beta {spec.dpo.beta} <= 0")
        if spec.dpo.loss not in DPO_LOSSES:
            problems.append(f"dpo loss {spec.dpo.loss!r} not in {DPO_LOSSES}")
        if not 0.0 <= spec.dpo.label_smoothing < 0.5:
            problems.append(f"dpo label_smoothing {spec.dpo.label_smoothing} outside [0, 0.5)")
    if problems:
        raise ValueError("invalid trial spec: " + "; ".join(problems))


def trial_seed(seed: int, stream: str) -> int:
    """Independent seeds for a trial's ``"init"`` / ``"dropout"`` / ``"data"`` streams, stable everywhere."""
    return (seed * 1_000_003 + zlib.crc32(stream.encode())) % 2**63
