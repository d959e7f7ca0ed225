"""The engine's DPO training (worker/engine/dpo.py, step.py) against Hugging Face TRL's ``DPOTrainer`` (TRL 1.16) with
a PEFT LoRA adapter, on the tiny random model: the same pairs in the same order, from the same initial adapter, give
the same per-step losses and the same adapter after a few steps, to about 1e-5 relative; and a pack of two DPO
trials (differing only in beta) and an IPO trial beside an SFT trial gives each preference trial what TRL gives it
alone.

What is pinned on TRL's side to make it the engine's training (``_trl_config``), each for a reason:

* ``bf16=False``: TRL defaults to bf16 mixed precision, also on the CPU; the engine trains the float32 tiny model
  in float32.
* ``activation_checkpointing=False`` (``gradient_checkpointing`` before transformers 5.24): TRL defaults to
  recomputing the layers (the same values, more time).
* ``max_grad_norm=0``: Trainer clips at 1.0 by default and clips only above 0; the spec leaves clipping off.
* ``optim="adamw_torch"``, ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``: torch's AdamW
  with the spec's (decoupled) hyperparameters, as the engine's; ``lr_scheduler_type="constant"`` and no warm-up.
  (The specs' own ``eps`` is 1e-3, on both sides: ``dpo_spec`` says why.)
* ``per_device_train_batch_size`` = the spec's batch of pairs, ``gradient_accumulation_steps=1``: one step is the
  mean of the DPO loss over one micro-batch of pairs, as the engine's.
* the data order: TRL is given the pairs in the order the trial's own ``BatchSampler`` draws them (epochs
  concatenated) and reads them in that order (``train_sampling_strategy="sequential"``).
* ``loss_type`` the spec's (``"sigmoid"``: on summed answer log-probabilities; ``"ipo"``: on per-token means, both
  TRL's as the engine's), ``beta``; ``peft_config`` with no ``ref_model``: TRL's reference is the model with its
  adapter disabled, the engine's the bare base. (The engine's ``label_smoothing`` is conservative DPO's, which TRL
  1.16 has no loss for: its ``"sigmoid"`` ignores label smoothing and its ``"robust"`` is another loss; not compared.)
* ``max_length`` the spec's ``max_seq_len`` (nothing is truncated: asserted).

TRL tokenises a text row as ``tokenizer(prompt)`` and ``tokenizer(prompt + answer + eos_token)``, the answer the
part after their common prefix. The engine encodes ``tokenizer(prompt)`` then ``tokenizer(answer,
add_special_tokens=False)`` and the eos id. For the tiny byte-level tokenizer (no BOS, no merges) these are the same
ids: the test asserts it, pair by pair, rather than assuming it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import CPU, TINY, assert_rel_close, make_spec
from worker.engine import PackEngine, TrialSpec, load_base_model
from worker.engine.data import IGNORE_INDEX, BatchSampler
from worker.engine.dpo import encode_preference_rows
from worker.engine.lora import resolve_target_modules
from worker.engine.spec import DpoObjective, trial_seed
from worker.engine.store import ModuleTensors

pytest.importorskip("trl", minversion="1.16")

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
# Every linear layer of the tiny Llama but lm_head (TRL refuses an adapter on the output head: it computes the
# log-probabilities from lm_head.weight directly).
DECODER_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def preference_rows(n: int) -> list[dict[str, Any]]:
    """Text pairs a tiny model can learn to tell apart: counting up is preferred to counting down."""
    return [{"prompt": f"count from {i}", "chosen": " " + " ".join(str(i + k) for k in range(4)),
             "rejected": " " + " ".join(str(i - k) for k in range(4))} for i in range(n)]


def dpo_spec(trial_id: str, beta: float, **overrides: Any) -> TrialSpec:
    """A DPO trial on six pairs, three a step, from a learning rate of 1e-2.

    AdamW's ``eps`` is 1e-3, not torch's 1e-8: its update ``lr * m / (sqrt(v) + eps)`` moves by up to ``lr / eps``
    times a change in a gradient element near zero, and a change of float32 rounding (the two gradients agree to
    about 1e-6 of their norm, ~1e-10..1e-8 absolute) then moved one element of a tiny rank-4 A or B by 1e-5..1e-4
    of the whole tensor's norm at 1e-8 (at 1e-6 too, for some seeds): not a difference of the training, but one
    that a 1e-5 comparison of adapters cannot tell from one. At 1e-3, for seeds 1 to 6 of both tests, A and B stay
    within 2.5e-6 and the losses within 3.5e-6."""
    fields: dict[str, Any] = {"train_rows": preference_rows(6), "val_rows": [], "dpo": DpoObjective(beta=beta),
                              "batch_size": 3, "max_steps": 4, "eval_interval": 4, "learning_rate": 1e-2,
                              "eps": 1e-3}
    return make_spec(trial_id, **(fields | overrides))


def sampler_order(spec: TrialSpec, steps: int) -> list[int]:
    """The pairs the trial trains on in its first ``steps`` steps, in order (its own seeded sampler's draws)."""
    sampler = BatchSampler(len(spec.train_rows), spec.batch_size, trial_seed(spec.seed, "data"))
    return [i for _ in range(steps) for i in sampler.next_indices()]


def _trl_config(spec: TrialSpec, steps: int, output_dir: Path) -> Any:
    from trl import DPOConfig

    # transformers 5.24 renamed gradient_checkpointing (TRL's default: on) to activation_checkpointing.
    recompute: dict[str, Any] = {("activation_checkpointing" if "activation_checkpointing" in
                                  DPOConfig.__dataclass_fields__ else "gradient_checkpointing"): False}

    assert spec.dpo is not None and spec.dpo.loss in ("sigmoid", "ipo") and spec.dpo.label_smoothing == 0.0
    assert spec.lr_schedule == "constant" and spec.warmup_steps == 0 and spec.max_grad_norm is None
    assert spec.lora_dropout == 0.0
    return DPOConfig(
        output_dir=str(output_dir), report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=False, **recompute, seed=spec.seed,
        max_steps=steps, per_device_train_batch_size=spec.batch_size, gradient_accumulation_steps=1,
        train_sampling_strategy="sequential",
        optim="adamw_torch", learning_rate=spec.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=spec.beta1, adam_beta2=spec.beta2, adam_epsilon=spec.eps, weight_decay=spec.weight_decay,
        max_grad_norm=0.0,
        beta=spec.dpo.beta, loss_type=[spec.dpo.loss], max_length=spec.max_seq_len, precompute_ref_log_probs=False,
    )


def trl_dpo(model_cache: Path, spec: TrialSpec, init: ModuleTensors, steps: int, output_dir: Path
            ) -> tuple[Any, list[float]]:
    """``spec`` trained ``steps`` steps by TRL's ``DPOTrainer`` on a fresh copy of the tiny model, its PEFT adapter
    starting from the engine's initial adapter ``init``. Returns the trainer and its per-step losses. Asserts that
    TRL reads the very token ids the engine does, pair by pair, in the engine's order."""
    import datasets
    import peft
    from trl import DPOTrainer

    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CPU)  # TRL patches the model it trains
    assert spec.lora_alpha.is_integer(), "PEFT's LoraConfig takes an integer alpha"
    order = sampler_order(spec, steps)
    trainer: Any = DPOTrainer(
        model=model, args=_trl_config(spec, steps, output_dir), processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list([spec.train_rows[i] for i in order]),
        peft_config=peft.LoraConfig(r=spec.lora_rank, lora_alpha=int(spec.lora_alpha), lora_dropout=0.0,
                                    target_modules=list(spec.target_modules)),
    )
    assert trainer.ref_model is None and "ref" not in trainer.model.peft_config  # the reference: adapter disabled

    # The same sequences and targets as the engine's (each pair's chosen, then its rejected; targets the answer's
    # tokens and the eos), none truncated.
    examples = encode_preference_rows(spec.train_rows, tokenizer, spec.max_seq_len)
    tokenised = trainer.train_dataset
    assert len(tokenised) == len(order)
    for row, pair in zip(tokenised, order, strict=True):
        for name, example in (("chosen", examples[2 * pair]), ("rejected", examples[2 * pair + 1])):
            ids = row["prompt_ids"] + row[f"{name}_ids"]
            assert len(ids) < spec.max_seq_len
            assert ids == example.input_ids, (pair, name)
            assert [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX] == list(
                range(len(row["prompt_ids"]), len(ids))), (pair, name)

    for path, (a, b) in init.items():
        layer = trainer.model.base_model.model.get_submodule(path)
        layer.lora_A["default"].weight.data.copy_(a)
        layer.lora_B["default"].weight.data.copy_(b)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps
    return trainer, losses


def train_engine(tiny: Tiny, specs: list[TrialSpec], steps: int
                 ) -> tuple[dict[str, ModuleTensors], dict[str, list[float]], dict[str, ModuleTensors]]:
    """``steps`` steps of ``specs`` in one engine: each trial's initial adapter, losses and final adapter."""
    model, tokenizer = tiny
    paths = sorted({p for s in specs for p in resolve_target_modules(model, s.target_modules)})
    with PackEngine(model, tokenizer, capacity=len(specs), max_rank=max(s.lora_rank for s in specs),
                    target_modules=paths) as engine:
        slots = {spec.trial_id: engine.admit(spec) for spec in specs}
        init = {trial_id: engine.adapter(slot) for trial_id, slot in slots.items()}
        losses: dict[str, list[float]] = {spec.trial_id: [] for spec in specs}
        for _ in range(steps):
            for trial_id, loss in engine.step().items():
                losses[trial_id].append(loss)
        final = {trial_id: engine.adapter(slot) for trial_id, slot in slots.items()}
    return init, losses, final


def assert_trained_alike(losses: list[float], trl_losses: list[float], adapter: ModuleTensors, trainer: Any) -> None:
    """The engine's losses and adapter equal TRL's within 1e-5 relative (losses each; A and B of every layer as
    whole tensors: ``assert_rel_close``)."""
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=0.0), (losses, trl_losses)
    peft_model = trainer.model.base_model.model
    assert adapter.keys() == {name.removesuffix(".lora_A") for name, _ in peft_model.named_modules()
                              if name.endswith(".lora_A")}
    for path, (a, b) in adapter.items():
        layer = peft_model.get_submodule(path)
        assert_rel_close(a, layer.lora_A["default"].weight.detach())
        assert_rel_close(b, layer.lora_B["default"].weight.detach())


def test_one_dpo_trial_trains_as_trls_dpo_trainer(tiny: Tiny, model_cache: Path, tmp_path: Path) -> None:
    """Six pairs, three a step, four steps (two epochs: the second in a new order), every decoder linear adapted,
    AdamW with weight decay and non-default moments."""
    spec = dpo_spec("d", 0.1, target_modules=DECODER_LINEARS, weight_decay=0.01, beta1=0.85, beta2=0.99)
    init, losses, final = train_engine(tiny, [spec], 4)
    trainer, trl_losses = trl_dpo(model_cache, spec, init["d"], 4, tmp_path)
    assert_trained_alike(losses["d"], trl_losses, final["d"], trainer)
    # Not vacuous: a fresh adapter is the reference (log 2 a pair), then the loss moves and the adapter trains.
    assert losses["d"][0] == pytest.approx(math.log(2.0), rel=1e-6)
    assert losses["d"][-1] < math.log(2.0) - 0.02
    assert min(float(b.abs().max()) for _, b in final["d"].values()) > 1e-3


def test_a_pack_trains_each_dpo_trial_as_trl_does_alone(tiny: Tiny, model_cache: Path, tmp_path: Path) -> None:
    """Two DPO trials that differ only in beta, packed with an IPO trial and an SFT trial: each preference trial's
    losses and adapter are TRL's for that trial alone, and the two DPO trials' differ (beta is what the comparison
    tells apart)."""
    specs = [dpo_spec("b01", 0.1), dpo_spec("b05", 0.5), dpo_spec("ipo", 0.3, dpo=DpoObjective(beta=0.3, loss="ipo"),
                                                                   learning_rate=2e-3, seed=7),
             make_spec("sft", batch_size=2)]
    steps = 3
    init, losses, final = train_engine(tiny, specs, steps)
    trl_losses = {}
    for spec in specs[:3]:
        trainer, trl_losses[spec.trial_id] = trl_dpo(model_cache, spec, init[spec.trial_id], steps,
                                                     tmp_path / spec.trial_id)
        assert_trained_alike(losses[spec.trial_id], trl_losses[spec.trial_id], final[spec.trial_id], trainer)
    assert len(losses["sft"]) == steps
    # The same seed, data and initial adapter: only beta differs, and the losses differ far beyond the tolerance.
    for trial_id in ("b01", "b05"):
        assert trl_losses[trial_id][0] == pytest.approx(math.log(2.0), rel=1e-6)
    assert abs(trl_losses["b01"][-1] - trl_losses["b05"][-1]) > 1e-2 * trl_losses["b01"][-1]
    # IPO starts at (1 / (2 beta))^2, then moves.
    assert trl_losses["ipo"][0] == pytest.approx((1 / 0.6) ** 2, rel=1e-6)
    assert trl_losses["ipo"][-1] < trl_losses["ipo"][0] - 0.02
