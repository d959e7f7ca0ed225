"""The training engine: a pack of LoRA trials on one frozen base model, one forward/backward per step.

Imports only the standard library, torch, transformers, tokenizers, safetensors and ``kernels``, so it runs
as it is on the GPU image (torch 2.11, transformers 5.17), which has none of the service's stack.

A whole pack, as a worker runs it::

    model, tokenizer = load_base_model(source, cache_dir=cache, device=torch.device("cuda"))
    config = PackConfig(base_model_name=source.name, export_dir=out,
                        checkpoint_dir=ckpt, checkpoint_interval_s=60.0)      # snapshot every minute
    callbacks = PackCallbacks(on_point=publish, should_stop=poll_evictions,
                              on_step=record_stats,                           # StepStats per pack step
                              on_checkpoint=upload, score=score_metric,       # the shell's metric scorer
                              on_adapter_checkpoint=keep_adapter)             # spec.adapter_checkpoints
    outcomes = train_pack(model, tokenizer, trials, config, callbacks,
                          resume={"trial-7": ckpt / "trial-7"})                # continue a trial exactly

The engine underneath, for benchmarks and for schedulers that back-fill slots::

    engine = PackEngine(model, tokenizer, capacity=32, max_rank=64,
                        target_modules=["all-linear"], device=torch.device("cuda"))
    slot = engine.admit(spec)                   # lowest free slot; fresh init from spec.seed, step 0
    slot = engine.admit(spec, resume=ckpt_dir)  # ... or continue from checkpoint(engine, slot, ckpt_dir)
    losses = engine.step()                      # {trial_id: loss} of every training slot; one sync
    engine.last_stats                           # StepStats of that step; engine.failures: failed trials
    evaluate(engine, slot)                      # validation loss; keeps the best adapter (validation.py)
    checkpoint(engine, slot, ckpt_dir)          # adapter, AdamW state, data cursor, best-val state (slot_export.py)
    export(engine, slot, out_dir, base_model_name=name)  # PEFT directory of the best adapter (slot_export.py)
    engine.evict(slot)                          # free the slot (zeros; nothing kept)
    engine.close()                              # unwrap the model (also on ``with PackEngine(...)``)

``generate(engine, {slot: prompts}, max_new_tokens=n, stop_ids=ids)`` (generation.py) decodes greedily under each
slot's adapter (all slots in shared forwards), for a task's generative metric.

``engine.state(slot)`` is the trial's ``SlotState`` (spec, steps_done, last_train_loss, best_val_loss,
best_step, training). Capacity, max rank and the set of wrappable layers are fixed when the engine starts.
"""

from worker.engine.base_model import ModelSource, load_base_model
from worker.engine.export import adapter_logits, export_peft_adapter, read_peft_adapter
from worker.engine.lora import restore_base_model
from worker.engine.pack_engine import PackEngine
from worker.engine.schedule import lr_at
from worker.engine.slots import SlotState, StepStats
from worker.engine.spec import AdapterCheckpoint, Evaluation, PackConfig, TrialOutcome, TrialSpec
from worker.engine.trainer import NoScore, PackCallbacks, train_pack

__all__ = [
    "AdapterCheckpoint",
    "Evaluation",
    "ModelSource",
    "NoScore",
    "PackCallbacks",
    "PackConfig",
    "PackEngine",
    "SlotState",
    "StepStats",
    "TrialOutcome",
    "TrialSpec",
    "adapter_logits",
    "export_peft_adapter",
    "load_base_model",
    "lr_at",
    "read_peft_adapter",
    "restore_base_model",
    "train_pack",
]
