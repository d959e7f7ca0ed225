"""What a user does with what they trained, through the real service (issue 35), on one task trained once by
`loraplane up` on the tiny model:

- merged export: `GET .../adapter?format=merged` answers 202 while a CPU worker builds the merged model, then the
  archive; `transformers` loads it, and its logits equal the base model's with the downloaded PEFT adapter;
- sampling: the worker's sampler answers completions. A trial's greedy answer equals PEFT's `generate` with the
  downloaded adapter; requests to two trials sent together are decoded in one batch and each gets its own adapter's
  answer; streaming gives the same text in OpenAI's chunks; `/v1/chat/completions` takes the task as `model`; the
  client and `loraplane sample` give the same answer;
- another tenant's task is a 404, bad formats and parameters are 422s, a prompt past the model's context a 422 from
  the worker, all in the one error shape;
- checkpoints: each trial keeps its best and its last (and its epochs' ends); the best checkpoint is the trial's
  adapter, a checkpoint downloads in PEFT format and samples as PEFT answers with it, the CLI lists them, and the
  tenant's usage counts their bytes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.registry import DEFAULT_MODELS
from loraplane.client import Client, Task
from tests.conftest import MODEL_CACHE
from tests.e2e.flow import (
    arithmetic_rows,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    tenant_client,
    upload,
    wait_for,
)
from tests.e2e.procs import EMBEDDED_UNSET, cluster, free_port, start_embedded
from worker.engine import load_base_model
from worker.engine.data import encode_prompt
from worker.gguf_export import permute_rows
from worker.model_cache import model_source

BUILD_CEILING_S = 600  # a merge of the tiny model takes seconds; a loaded 2-core machine may queue it a while
PROMPTS = ["3 plus 4 is", "10 plus 11 is", "7 plus 8 is"]
BURSTS = 8  # bursts of concurrent requests tried until one is decoded as one batch (a loaded machine may split some)


@dataclass
class Trained:
    """The service, a tenant's task trained to its end, and a second tenant."""

    base_url: str
    lp: Client
    other: Client
    task: Task
    ended: Task
    tmp: Path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    tmp = tmp_path_factory.mktemp("trained")
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1", "LORAPLANE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1"})
    port = free_port()
    dead_tracker = free_port()  # an MLflow server that is down the whole time
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp) as c:
        _, token = start_embedded(c, port)
        with tenant_client(base_url, token, "team-trained") as lp, \
                tenant_client(base_url, token, "team-other") as other:
            spec = {**grid_task(upload(lp, arithmetic_rows())),  # checkpoints: the default
                    "integrations": [{"type": "mlflow", "tracking_uri": f"http://127.0.0.1:{dead_tracker}"}]}
            task = submit(lp, spec)
            _, ended = follow_events(lp, task.id)
            assert ended.state == "succeeded" and ended.best_trial is not None
            yield Trained(base_url, lp, other, task, ended, tmp)


def base_model_and_tokenizer() -> tuple[Any, Any]:
    definition = next(d for d in DEFAULT_MODELS if d.name == "tiny-random-llama")
    source = model_source({"name": definition.name, "kind": definition.kind, "path": definition.path,
                           "package": definition.package, "gguf_file": definition.gguf_file})
    return load_base_model(source, cache_dir=MODEL_CACHE, device=torch.device("cpu"))


def base_and_adapter_logits(adapter_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model, _ = base_model_and_tokenizer()
    with torch.no_grad():
        return PeftModel.from_pretrained(model, str(adapter_dir))(input_ids=input_ids).logits


def test_the_merged_model_is_built_once_on_a_worker_and_equals_base_plus_adapter(trained: Trained) -> None:
    base_url, lp, other, task, ended, tmp_path = (trained.base_url, trained.lp, trained.other, trained.task,
                                                  trained.ended, trained.tmp)
    assert ended.best_trial is not None
    url = f"{base_url}/v1/tasks/{task.id}/adapter?format=merged"
    mine = {"Authorization": f"Bearer {lp.api_key}"}

    first = httpx.get(url, headers=mine, timeout=30)
    assert first.status_code == 202 and first.headers["Retry-After"] == "5", first.text
    assert first.json()["status"] == "building"
    leak = httpx.get(f"{base_url}/v1/tasks/{task.id}/trials/{ended.best_trial.id}/adapter?format=merged",
                     headers={"Authorization": f"Bearer {other.api_key}"}, timeout=30)
    assert leak.status_code == 404 and leak.json()["error"]["code"] == "task_not_found", leak.text
    bad = httpx.get(f"{base_url}/v1/tasks/{task.id}/adapter?format=gguf-please", headers=mine, timeout=30)
    assert bad.status_code == 422 and "merged" in bad.json()["error"]["message"], bad.text

    def built() -> httpx.Response | None:
        r = httpx.get(url, headers=mine, timeout=60)
        assert r.status_code in (200, 202), r.text  # a failed build would be a 409 export_failed
        return r if r.status_code == 200 else None

    merged = wait_for(built, BUILD_CEILING_S, "the merged model", interval_s=1.0)
    adapter = download_adapter(lp, task.id, tmp_path / "adapter")
    # The client waits out another trial's build itself (202s and Retry-After).
    runner_up = next(t for t in lp.tasks.trials(task.id).data if t.id != ended.best_trial.id)
    by_client = lp.tasks.download_adapter(task.id, tmp_path / "runner-up", trial_id=runner_up.id, merged=True,
                                          timeout=BUILD_CEILING_S)
    assert {"config.json", "model.safetensors"} <= {p.name for p in by_client.iterdir()}
    merged_dir = tmp_path / "merged"
    with tarfile.open(fileobj=io.BytesIO(merged.content), mode="r:gz") as tar:
        tar.extractall(merged_dir, filter="data")
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged in: a plain model
    input_ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        got = model(input_ids=input_ids).logits
    want = base_and_adapter_logits(adapter, input_ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def peft_answer(adapter_dir: Path, prompt: str, max_tokens: int) -> str:
    """What a user gets from PEFT with the downloaded adapter: greedy `generate`, the prompt encoded as training
    encodes a prompt/completion row's prompt."""
    model, tokenizer = base_model_and_tokenizer()
    peft = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([encode_prompt(tokenizer, prompt=prompt)])
    out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def post(url: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def sse_chunks(url: str, key: str, body: dict[str, Any]) -> list[Any]:
    chunks: list[Any] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers={"Authorization": f"Bearer {key}"},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return chunks


def test_completions_from_trials_through_the_service(trained: Trained) -> None:
    base_url, lp, other, task, ended, tmp_path = (trained.base_url, trained.lp, trained.other, trained.task,
                                                  trained.ended, trained.tmp)
    assert ended.best_trial is not None
    trials = [t.id for t in lp.tasks.trials(task.id).data if t.state == "completed"][:2]
    adapters = {t: download_adapter(lp, task.id, tmp_path / t, trial_id=t) for t in trials}
    key = lp.api_key
    assert key is not None and other.api_key is not None

    # The best trial's greedy answer equals PEFT's, and says which trial answered and what it cost.
    best = post(f"{base_url}/v1/tasks/{task.id}/completions", key,
                {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert best.status_code == 200, best.text
    answer = best.json()
    assert answer["object"] == "text_completion" and answer["loraplane"]["trial_id"] == ended.best_trial.id
    best_adapter = download_adapter(lp, task.id, tmp_path / "best")
    assert answer["choices"][0]["text"] == peft_answer(best_adapter, PROMPTS[0], 8)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= answer["usage"]["completion_tokens"] <= 8 and answer["usage"]["prompt_tokens"] > 0

    check_batched_trials(base_url, key, task.id, adapters)
    check_streaming_and_chat(base_url, key, task.id)
    check_client_and_cli(lp, base_url, key, task.id, answer["choices"][0]["text"])
    check_refusals(base_url, key, other.api_key, task.id, trials[0])


def check_batched_trials(base_url: str, key: str, task_id: str, adapters: dict[str, Path]) -> None:
    """Requests to two trials sent at once: each answer is its own adapter's, and they were decoded together."""
    want = {(t, p): peft_answer(a, p, 6) for t, a in adapters.items() for p in PROMPTS[:2]}
    largest = 0
    with ThreadPoolExecutor(len(want)) as pool:
        for _ in range(BURSTS):
            futures = {pair: pool.submit(post, f"{base_url}/v1/tasks/{task_id}/trials/{pair[0]}/completions", key,
                                         {"prompt": pair[1], "max_tokens": 6, "temperature": 0})
                       for pair in want}
            for pair, future in futures.items():
                r = future.result()
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want[pair], pair
                largest = max(largest, r.json()["loraplane"]["batch_requests"])
            if largest >= 2:
                break
    assert largest >= 2, "no two concurrent requests were ever decoded together"


def check_streaming_and_chat(base_url: str, key: str, task_id: str) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0.8, "seed": 5}
    whole = post(f"{base_url}/v1/tasks/{task_id}/completions", key, body).json()
    chunks = sse_chunks(f"{base_url}/v1/tasks/{task_id}/completions", key, body)
    assert chunks[-1] == "[DONE]" and len(chunks) >= 2
    pieces = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in pieces) == whole["choices"][0]["text"]  # same seed, same text
    assert pieces[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert pieces[-1]["usage"] == whole["usage"]

    chat = post(f"{base_url}/v1/chat/completions", key,
                {"model": task_id, "messages": [{"role": "user", "content": "2 plus 3?"}], "max_tokens": 5})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion" and chat.json()["choices"][0]["message"]["role"] == "assistant"
    base = post(f"{base_url}/v1/chat/completions", key,
                {"model": "tiny-random-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert base.status_code == 200 and base.json()["loraplane"]["trial_id"] is None, base.text
    streamed = sse_chunks(f"{base_url}/v1/chat/completions", key,
                          {"model": task_id, "messages": [{"role": "user", "content": "1 plus 2?"}], "max_tokens": 4})
    assert streamed[0]["object"] == "chat.completion.chunk"
    assert streamed[0]["choices"][0]["delta"]["role"] == "assistant"


def check_client_and_cli(lp: Client, base_url: str, key: str, task_id: str, best_text: str) -> None:
    """The Python client (whole and streamed) and `loraplane sample` give the best trial's greedy answer; a stop
    string cuts it."""
    got = lp.tasks.complete(task_id, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert got.text == best_text and got.finish_reason in ("stop", "length") and got.completion_tokens >= 1
    assert "".join(lp.tasks.complete_stream(task_id, prompt=PROMPTS[0], max_tokens=8, temperature=0)) == best_text
    # A stop string ends the answer before it, whole and streamed alike.
    assert best_text, "an empty answer proves nothing about stop strings"
    stop = best_text[-1]
    cut = best_text[: best_text.index(stop)]
    got = lp.tasks.complete(task_id, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop])
    assert got.text == cut and got.finish_reason == "stop"
    assert "".join(lp.tasks.complete_stream(task_id, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                            stop=[stop])) == cut
    cli = subprocess.run([sys.executable, "-m", "loraplane.cli", "sample", task_id, PROMPTS[0], "--max-tokens", "8",
                          "--temperature", "0", "--api-url", base_url, "--api-key", key],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stdout == best_text + "\n", (cli.stdout, cli.stderr)


def check_refusals(base_url: str, key: str, other_key: str, task_id: str, trial_id: str) -> None:
    url = f"{base_url}/v1/tasks/{task_id}/trials/{trial_id}/completions"
    leak = post(url, other_key, {"prompt": "1 plus 2 is"})
    assert leak.status_code == 404 and leak.json()["error"]["code"] == "task_not_found", leak.text
    leak = post(f"{base_url}/v1/chat/completions", other_key,
                {"model": task_id, "messages": [{"role": "user", "content": "hi"}]})
    assert leak.status_code == 404 and leak.json()["error"]["code"] == "model_not_found", leak.text
    for bad in ({"prompt": "x", "temperature": 3}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                {}, {"prompt": "x", "n": 2}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "stop": ["a"] * 5},
                {"prompt": "x", "top_p": 0}, {"prompt": "x\u0000"}):
        r = post(url, key, bad)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)
    too_long = post(url, key, {"prompt": "1 plus 2 is " * 200, "max_tokens": 4096})
    assert too_long.status_code == 422 and too_long.json()["error"]["code"] == "context_length_exceeded", too_long.text


def test_sampling_tokens_count_in_the_tenants_usage(trained: Trained) -> None:
    """Each answered request's prompt and answer tokens go to its tenant's usage (`sampling_tokens`), streamed or
    not; another tenant's usage does not move."""
    lp, other, task = trained.lp, trained.other, trained.task
    before, theirs = lp.usage().sampling_tokens, other.usage().sampling_tokens
    assert before is not None and theirs is not None
    whole = lp.tasks.complete(task.id, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    pieces = list(lp.tasks.complete_stream(task.id, prompt=PROMPTS[0], max_tokens=5, temperature=0))
    assert "".join(pieces) == whole.text  # the same greedy answer: the same tokens
    spent = whole.prompt_tokens + whole.completion_tokens
    assert spent > 0 and lp.usage().sampling_tokens == before + 2 * spent
    assert other.usage().sampling_tokens == theirs

def test_checkpoints_are_listed_downloaded_sampled_and_counted(trained: Trained) -> None:
    base_url, lp, other, task, ended, tmp_path = (trained.base_url, trained.lp, trained.other, trained.task,
                                                  trained.ended, trained.tmp)
    assert ended.best_trial is not None and lp.api_key is not None
    trial = lp.tasks.trial(task.id, ended.best_trial.id)
    kept = lp.tasks.checkpoints(task.id, trial.id).data
    assert kept[-1].step == trial.steps_done and "last" in kept[-1].kinds
    best = next(c for c in kept if "best" in c.kinds)
    assert best.step == trial.best_step and best.val_loss == pytest.approx(trial.best_val_loss)
    # The best checkpoint is the trial's adapter, tensor for tensor.
    adapter = download_adapter(lp, task.id, tmp_path / "ckpt-trial", trial_id=trial.id)
    at_best = lp.tasks.download_adapter(task.id, tmp_path / "ckpt-best", trial_id=trial.id, checkpoint=best.step)
    want, have = load_file(adapter / "adapter_model.safetensors"), load_file(at_best / "adapter_model.safetensors")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    # The last one samples as PEFT answers with it, through the completions endpoint and chat's `model`.
    last = lp.tasks.download_adapter(task.id, tmp_path / "ckpt-last", trial_id=trial.id, checkpoint=kept[-1].step)
    got = lp.tasks.complete(task.id, trial_id=trial.id, checkpoint=kept[-1].step, prompt=PROMPTS[1], max_tokens=6,
                            temperature=0)
    assert got.text == peft_answer(last, PROMPTS[1], 6)
    chat = post(f"{base_url}/v1/chat/completions", lp.api_key,
                {"model": kept[-1].model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["loraplane"]["checkpoint_step"] == kept[-1].step, chat.text
    # Another tenant sees none of them; the tenant's usage counts every trial's.
    leak = httpx.get(f"{base_url}/v1/tasks/{task.id}/trials/{trial.id}/checkpoints",
                     headers={"Authorization": f"Bearer {other.api_key}"}, timeout=30)
    assert leak.status_code == 404, leak.text
    every = sum(c.size_bytes for t in lp.tasks.trials(task.id).data for c in lp.tasks.checkpoints(task.id, t.id).data)
    assert lp.usage().checkpoint_bytes == every > 0
    cli = subprocess.run([sys.executable, "-m", "loraplane.cli", "tasks", "checkpoints", task.id, trial.id, "--json",
                          "--api-url", base_url, "--api-key", lp.api_key], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and [c["step"] for c in json.loads(cli.stdout)] == [c.step for c in kept], cli.stderr
    # Deleted from the CLI (the other trials' are left for the tests after this one): its bytes leave the usage.
    first = kept[0]
    cli = subprocess.run([sys.executable, "-m", "loraplane.cli", "tasks", "delete-checkpoint", task.id, trial.id,
                          str(first.step), "--api-url", base_url, "--api-key", lp.api_key], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and f"step {first.step}" in cli.stdout, cli.stderr
    assert [c.step for c in lp.tasks.checkpoints(task.id, trial.id).data] == [c.step for c in kept[1:]]
    assert lp.usage().checkpoint_bytes == every - first.size_bytes


def test_a_tracker_that_is_down_delays_nothing(trained: Trained) -> None:
    """The task trained to its end beside a tracker that never answered; the tracker is behind, each trial's run
    waiting with why (tests/scheduler/test_trackers.py: it catches up once the server answers)."""
    assert trained.ended.state == "succeeded"
    started = {t.id for t in trained.lp.tasks.trials(trained.task.id).data if t.started_at is not None}

    def behind() -> dict[str, Any] | None:
        (tracker,) = httpx.get(f"{trained.base_url}/v1/tasks/{trained.task.id}/integrations",
                               headers={"Authorization": f"Bearer {trained.lp.api_key}"}, timeout=30).json()["data"]
        tried = {r["trial_id"] for r in tracker["runs"] if r["attempts"] >= 1}
        return tracker if tried == started else None

    tracker = wait_for(behind, 120, "an attempt at each trial's run")
    assert not tracker["done"] and started
    assert all(not r["finished"] and r["run_id"] is None and r["last_error"] == "could not connect"
               for r in tracker["runs"]), tracker


def test_the_gguf_adapter_has_the_trained_adapter_under_llama_cpps_names(trained: Trained) -> None:
    """`download_gguf` waits for a worker's build; the file, read by the `gguf` package, holds the downloaded PEFT
    adapter's tensors under llama.cpp's names, the query's rows permuted as llama.cpp's converter permutes its base."""
    lp, task, tmp_path = trained.lp, trained.task, trained.tmp
    written = lp.tasks.download_gguf(task.id, tmp_path / "adapter.gguf", timeout=BUILD_CEILING_S)
    adapter = load_file(download_adapter(lp, task.id, tmp_path / "gguf-peft") / "adapter_model.safetensors")
    reader = gguf.GGUFReader(written)
    assert reader.fields["general.type"].contents() == "adapter"
    read = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    config = base_model_and_tokenizer()[0].config
    for layer in range(config.num_hidden_layers):
        for proj, name in (("q_proj", "attn_q"), ("v_proj", "attn_v")):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
            torch.testing.assert_close(read[f"blk.{layer}.{name}.weight.lora_a"], a.float())
            want = permute_rows(b.float(), config.num_attention_heads) if proj == "q_proj" else b.float()
            torch.testing.assert_close(read[f"blk.{layer}.{name}.weight.lora_b"], want)
