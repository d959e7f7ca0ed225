"""Turns a recorded pack into the message a worker runs (common/messages.py), and sends it on the worker's queue.

Sending is idempotent end to end: the message is rebuilt from the database each time, and the worker
claims the pack id on the bus before running it, so a pack re-sent after a scheduler restart (or after
its message was lost) runs at most once.
"""

from __future__ import annotations

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session, object_session

from common.artifacts import file_key
from common.celery import RUN_PACK_TASK
from common.messages import ModelSourceFields, PackMessage, TrialPayload
from common.registry import model_source_fields
from common.tables import BaseModelEntry, Pack, Task, Trial, Worker
from scheduler.early_exit.config import EarlyExitSpecError, from_spec
from scheduler.early_exit.policy import asha_rung_steps, rung_steps
from scheduler.planning.cost import tokens_per_step


def trial_payload(trial: Trial, task: Task) -> TrialPayload:
    """What a worker needs to train one trial (in a pack message, or in an `admit_trials` command)."""
    spec = task.parsed_spec
    return TrialPayload(
        trial_id=trial.id,
        task_id=task.id,
        hyperparameters=trial.hyperparameters,
        total_steps=trial.total_steps,
        max_seq_len=spec.max_seq_len,
        eval_interval=spec.eval_interval,
        training_file_key=file_key(task.training_file_id),
        validation_file_key=file_key(task.validation_file_id) if task.validation_file_id else None,
        validation_split=spec.validation_split,
        # The split depends on the task only, so every trial validates on the same rows.
        split_seed=spec.seed,
        training=dict(spec.training),
        # A generative metric has the worker score the trial's best adapter when it ends. None: loss (a task stored
        # before `evaluation` existed), and a refit's: it has no validation rows left to score.
        evaluation=spec.evaluation.as_dict() if spec.evaluation and trial.refit_of is None else None,
        objective=spec.objective.as_dict() if spec.objective.dpo else None,
        # A requeued trial resumes from its newest checkpoint instead of step 0.
        resume_key=trial.checkpoint_key,
        resume_step=trial.checkpoint_step,
        extra_eval_steps=eval_steps(task, trial),
        refit=trial.refit_of is not None,
        # Tells one placement from the next (a trial paused and placed again in the same pack).
        placed_at=trial.started_at.isoformat() if trial.started_at else None,
    )


def eval_steps(task: Task, trial: Trial) -> list[int]:
    """Steps the task's early-exit policy must see a validation at besides the regular ones: alto ranks each
    trial at its warm-up rungs, ASHA at its token rungs, so the trial validates exactly there (not at the next
    regular validation, which may be far past it). A refit validates on nothing."""
    if trial.refit_of is not None:
        return []
    try:
        config = from_spec(task.parsed_spec.early_exit)
    except EarlyExitSpecError:
        return []
    if config.policy == "alto":
        return sorted(set(rung_steps(config, trial.total_steps)))
    if config.policy == "asha":
        session = object_session(trial)
        assert session is not None
        # Tokens per step as the policy counts them (scheduler/service/exits.py): batch size x max_seq_len.
        max_seq_len = task.parsed_spec.max_seq_len
        budget = max(steps * tokens_per_step(hp, max_seq_len) for steps, hp in session.execute(
            select(Trial.total_steps, Trial.hyperparameters).where(Trial.task_id == task.id)))
        return list(asha_rung_steps(config, budget, tokens_per_step(trial.hyperparameters, max_seq_len),
                                    trial.total_steps))
    return []


def pack_message(session: Session, pack: Pack) -> PackMessage:
    entry = session.get(BaseModelEntry, pack.base_model)
    assert entry is not None, pack.base_model
    trials = session.scalars(select(Trial).where(Trial.id.in_(pack.trial_ids)).order_by(Trial.id)).all()
    specs = []
    for trial in trials:
        task = session.get(Task, trial.task_id)
        assert task is not None
        specs.append(trial_payload(trial, task))
    return PackMessage(pack_id=pack.id, worker_id=pack.worker_id,
                       base_model=ModelSourceFields.model_validate(model_source_fields(entry)), trials=specs,
                       capacity=pack.capacity, max_rank=pack.max_rank, target_modules=pack.target_modules,
                       memory_bytes=pack.memory_bytes)


def send_pack(celery: Celery, session: Session, pack: Pack) -> None:
    worker = session.get(Worker, pack.worker_id)
    assert worker is not None, pack.worker_id
    celery.send_task(RUN_PACK_TASK, kwargs={"pack": pack_message(session, pack).to_dict()}, queue=worker.queue)
