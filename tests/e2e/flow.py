"""The user's journey through the public API with the Python client (`loraplane.client`), shared by the
distributed and the embedded end-to-end tests: they are the client's end-to-end tests too."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

from loraplane.client import APIConnectionError, APIError, Client, Event, Task

T = TypeVar("T")


def arithmetic_rows(n: int = 32) -> bytes:
    """A small learnable dataset: prompt/completion additions (the completion is the only target)."""
    rows = [{"prompt": f"{a} plus {a + 1} is", "completion": f" {2 * a + 1}"} for a in range(n)]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def tenant_client(base_url: str, admin_token: str, name: str) -> Client:
    """A new tenant with a new API key, and the client that uses it (the caller closes it)."""
    with Client(base_url, admin_token=admin_token, timeout=10) as operator:
        tenant = operator.admin.create_tenant(name)
        key = operator.admin.create_api_key(tenant.id, name="ci")
    assert key.key is not None and key.tenant_id == tenant.id
    return Client(base_url, key.key, admin_token=admin_token, timeout=30)


def upload(lp: Client, data: bytes, filename: str = "train.jsonl") -> str:
    return lp.files.upload(data, filename=filename).id


def submit(lp: Client, body: dict[str, Any]) -> Task:
    return lp.tasks.create(body)


def grid_task(file_id: str, base_model: str = "tiny-random-llama", max_steps: int = 6) -> dict[str, Any]:
    return {
        "base_model": base_model,
        "training_file": file_id,
        "validation_split": 0.2,
        "search_space": {"learning_rate": [1e-3, 5e-3], "lora_rank": [2, 4], "batch_size": [4],
                         "target_modules": [["q_proj", "v_proj"]]},
        "strategy": "grid",
        "max_steps": max_steps,
        "max_seq_len": 64,
        "eval_interval": 3,
        "seed": 7,
    }


# How long a wait on work in progress (training, recovering) goes on with NOTHING moving before it fails: longer than
# any pause a healthy run has (a worker process starting on two loaded cores, a quarantine, a database outage), and
# the overall ceiling that bounds even a run that moves all along. A loaded machine is slow, not stuck: it is waited
# for as long as it moves (on 2026-11-26 fixed timeouts failed 4 chaos tests beside other heavy jobs).
STALL_S = 240.0
CEILING_S = 1800.0


def task_progress(lp: Client, task_id: str) -> Hashable:
    """What moves while a task is worked on: its state, each trial's state, steps, checkpoint and attempts."""
    trials = lp.tasks.trials(task_id).data
    return lp.tasks.get(task_id).state, tuple(sorted(
        (t.id, t.state, t.steps_done, t.checkpoint_step, t.attempts) for t in trials))


def wait_progressing(done: Callable[[], T | None], progress: Callable[[], Hashable], what: str, *,
                     stall_s: float = STALL_S, ceiling_s: float = CEILING_S, interval_s: float = 0.5) -> T:
    """Polls ``done`` until it returns something truthy, which is returned. Fails only when ``progress()`` (any
    snapshot of the work: steps, states, events seen) stayed the same for ``stall_s`` — nothing moved — or after
    ``ceiling_s`` overall. A progress read that fails (the API answering 503 during an outage) counts as no move."""
    started = moved_at = time.monotonic()
    seen: Hashable = None
    while True:
        value = done()
        if value:
            return value
        now = time.monotonic()
        try:
            current = progress()
        except (APIError, APIConnectionError):
            current = seen
        if current != seen:
            seen, moved_at = current, now
        if now - moved_at > stall_s:
            raise TimeoutError(f"nothing moved for {stall_s:.0f}s while waiting for {what} (last seen: {seen})")
        if now - started > ceiling_s:
            raise TimeoutError(f"waited {ceiling_s:.0f}s for {what}, moving but not there (last seen: {seen})")
        time.sleep(interval_s)


def follow_events(lp: Client, task_id: str, *, stall_s: float = STALL_S,
                  ceiling_s: float = CEILING_S) -> tuple[list[Event], Task]:
    """Reads the task's SSE stream (the stream only: no polling fallback) to its `end`, as the task runs; returns
    the events and the task as it ended. Fails when neither the stream nor the task moved for ``stall_s``
    (`wait_progressing`). The stream is read on a thread of its own; the task is watched through a client of its
    own (one client is not shared between threads)."""
    events: list[Event] = []
    failed: list[BaseException] = []

    def read() -> None:
        try:
            events.extend(lp.tasks.stream_events(task_id, timeout=ceiling_s))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(exc)

    reader = threading.Thread(target=read, name=f"sse-{task_id}", daemon=True)
    reader.start()
    with Client(lp.base_url, lp.api_key, timeout=30) as watcher:
        wait_progressing(lambda: not reader.is_alive(), lambda: (len(events), task_progress(watcher, task_id)),
                         f"the end of task {task_id}'s event stream", stall_s=stall_s, ceiling_s=ceiling_s)
    if failed:
        raise failed[0]
    task = lp.tasks.get(task_id)
    assert task.done, task  # the stream ends only once the task is final
    return events, task


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def download_adapter(lp: Client, task_id: str, into: Path, trial_id: str | None = None) -> Path:
    """The best adapter of the task (or `trial_id`'s), unpacked into `into`."""
    assert lp.tasks.download_adapter(task_id, into, trial_id=trial_id) == into
    assert {p.name for p in into.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    return into


def assert_adapter_changes_output(adapter_dir: Path, base_model: str, model_cache: Path) -> None:
    """The downloaded adapter loads with PEFT on a fresh base model and changes its logits."""
    import torch
    from peft import PeftModel

    from common.registry import DEFAULT_MODELS
    from worker.engine import load_base_model
    from worker.model_cache import model_source

    definition = next(d for d in DEFAULT_MODELS if d.name == base_model)
    source = model_source({"name": definition.name, "kind": definition.kind, "path": definition.path,
                           "package": definition.package, "gguf_file": definition.gguf_file})
    model, tokenizer = load_base_model(source, cache_dir=model_cache, device=torch.device("cpu"))
    inputs = tokenizer("3 plus 4 is", return_tensors="pt")
    with torch.no_grad():
        base_logits = model(**inputs).logits.clone()
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
        tuned_logits = peft_model(**inputs).logits
    assert (tuned_logits - base_logits).abs().max().item() > 1e-4
