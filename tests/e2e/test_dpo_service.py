"""A DPO task through the real service (issue 36), as a user runs it with `loraplane up`: preference rows uploaded,
a grid over learning rate x beta judged by reward accuracy, ALTO's early exit stopping the half that rank lowest at
its warm-up rung, the best trial the one of highest reward accuracy, its adapter downloaded and loaded in PEFT, where
the reward accuracy it gives the validation pairs against the bare base is the score the service reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from common.registry import DEFAULT_MODELS
from tests.conftest import MODEL_CACHE
from tests.e2e.flow import download_adapter, follow_events, submit, tenant_client, upload
from tests.e2e.procs import embedded_service
from worker.engine import load_base_model
from worker.engine.dpo import encode_preference_row
from worker.model_cache import model_source


def preference_rows(numbers: range) -> list[dict[str, str]]:
    """Additions, the right sum preferred to one off by one."""
    return [{"prompt": f"{a} plus {a + 1} is", "chosen": f" {2 * a + 1}", "rejected": f" {2 * a + 2}"}
            for a in numbers]


def jsonl(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def log_probs(model: torch.nn.Module, tokenizer: object, rows: list[dict[str, str]]) -> torch.Tensor:
    """``(pairs, 2)`` summed log-probabilities of each pair's chosen and rejected answer, each sequence alone."""
    out = []
    for row in rows:
        pair = encode_preference_row(row, tokenizer, 64)  # type: ignore[arg-type]
        assert pair is not None
        sums = []
        for example in (pair.chosen, pair.rejected):
            with torch.no_grad():
                logits = model(torch.tensor([example.input_ids])).logits[0, :-1].float()
            labels = torch.tensor(example.labels[1:])
            mask = labels != -100
            sums.append(torch.log_softmax(logits[mask], -1).gather(1, labels[mask, None]).sum())
        out.append(torch.stack(sums))
    return torch.stack(out)


def test_a_dpo_grid_with_early_exit_picks_the_best_reward_accuracy_and_its_adapter_loads_in_peft(
        tmp_path: Path) -> None:
    val_rows = preference_rows(range(40, 52))
    with embedded_service(tmp_path) as (base_url, token):
        with tenant_client(base_url, token, "team-dpo") as lp:
            body = {
                "base_model": "tiny-random-llama", "training_file": upload(lp, jsonl(preference_rows(range(32)))),
                "validation_file": upload(lp, jsonl(val_rows), filename="val.jsonl"),
                "objective": {"type": "dpo"}, "evaluation": {"metric": "reward_accuracy"},
                "search_space": {"learning_rate": [1e-3, 1e-2], "beta": [0.1, 0.5], "lora_rank": [4],
                                 "target_modules": [["q_proj", "v_proj"]]},
                "max_steps": 300, "eval_interval": 100, "max_seq_len": 64, "seed": 3,
                # Ranked once, at the warm-up rung, by reward accuracy: half go on (divergence and overfitting off).
                "early_exit": {"policy": "alto", "rungs": 1, "keep_ratio": 0.5, "tau_slope": 100.0,
                               "tau_gap": 100.0},
            }
            task = submit(lp, body)
            assert task.dpo and task.metric == "reward_accuracy"
            events, ended = follow_events(lp, task.id)
            assert ended.state == "succeeded", [(e.type, e.message) for e in events]
            trials = lp.tasks.trials(task.id).data
            assert sorted((t.hyperparameters["learning_rate"], t.hyperparameters["beta"]) for t in trials) == [
                (1e-3, 0.1), (1e-3, 0.5), (1e-2, 0.1), (1e-2, 0.5)]
            stopped = [e for e in events if e.type == "trial.stopped_early"]
            assert len(stopped) == 2 and all(e.data["reason"] == "underperforming" for e in stopped), stopped
            done = [t for t in trials if t.state == "completed"]
            assert len(done) == 2 and all(t.metric_score is not None for t in done)
            assert ended.best_trial is not None
            best = next(t for t in trials if t.id == ended.best_trial.id)
            assert best.metric_score == max(t.metric_score or 0.0 for t in done)
            curves = {row["trial_id"]: row for row in lp.tasks.curves(task.id)}
            rewards = curves[best.id]["rewards"]
            # validated at the warm-up rung (5% of 300 steps) and every 100 steps, each with its reward metrics
            steps = [p[0] for p in curves[best.id]["val"]]
            assert steps == [p[0] for p in rewards["reward_acc"]] == [15, 100, 200, 300]
            assert all(len(rewards[split]) == 4 for split in ("margin", "chosen", "rejected"))
            adapter = download_adapter(lp, task.id, tmp_path / "best")
    # The downloaded adapter, loaded in PEFT: its reward accuracy on the validation pairs against the bare base is the
    # score the service reported for it (the score of the adapter it exported: its best validation's).
    definition = next(d for d in DEFAULT_MODELS if d.name == "tiny-random-llama")
    source = model_source({"name": definition.name, "kind": definition.kind, "path": definition.path,
                           "package": definition.package, "gguf_file": definition.gguf_file})
    model, tokenizer = load_base_model(source, cache_dir=MODEL_CACHE, device=torch.device("cpu"))
    reference = log_probs(model, tokenizer, val_rows)
    policy = log_probs(PeftModel.from_pretrained(model, str(adapter)), tokenizer, val_rows)
    ratio = policy - reference
    accuracy = ((ratio[:, 0] - ratio[:, 1]) > 0).float().mean().item()
    assert accuracy == pytest.approx(best.metric_score, abs=1.5 / len(val_rows))
    assert (ratio.abs() > 1e-4).any()  # the adapter moved the policy away from the base
