"""A worker's sampler (issue 35): answers sampling requests for trained adapters, batched on a warm base model.

The API puts each request (`SampleRequest`) on its base model's stream (`common.bus.sampling_stream`). Every worker
runs one sampler process beside its packs (`SamplerProcess`, spawned once sampling is first asked of it;
`LORAPLANE_WORKER_SAMPLER`), which reads the streams of the models its worker can load, as one consumer group: each
request is taken once, by one worker. It takes up to `LORAPLANE_SAMPLER_MAX_BATCH` waiting requests of one model at a
time and decodes them together under their adapters (worker/engine/sampling.py: one forward per new token for all of
them, each row under its own adapter, with a KV cache), and writes each answer in pieces on the request's own stream
(`SampleReply`): a streaming request's text as it comes, every request's end with why it ended and what it cost
(tokens, time queued, time spent loading).

Why a process of its own: a pack runs for minutes and a sampling request should not wait for it, nor a pack's step
for a request. The sampler holds its own copy of the base model (loaded on the first request for it, the wait stated
in the answer's `load_s`; dropped after `LORAPLANE_SAMPLER_IDLE_S` without requests) and its adapters, fetched from the
artifact store and kept (`ADAPTERS_KEPT`, least recently used dropped). A batch answers its requests at once: a
request that arrives while one decodes waits for the next (no continuous batching).

What it holds on the device (`Sampler.held_bytes`: the CUDA allocator's reserved bytes, on a CPU its model's and
adapters' tensors) goes to the worker process after every load, batch and unload (`SamplerProcess.held_bytes`), and on
in each heartbeat (`sampler_bytes`): the planner gives packs the worker's memory less it
(`scheduler.service.cluster_state.pack_memory`), so a pack is never planned into memory the sampler holds. A pack
already running when the sampler loads is not resized: the sampler's model then sits in memory the pack's plan left
over (the plan keeps headroom), or fails to load and answers 503.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.artifacts import LocalArtifactStore
from common.bus import SAMPLERS_GROUP, Bus, sampling_reply_stream, sampling_stream
from common.messages import SampleReply, SampleRequest, parse_sample_request
from worker.availability import ModelAvailability
from worker.engine.base_model import load_base_model
from worker.engine.data import encode_prompt
from worker.engine.export import read_peft_adapter
from worker.engine.generation import stop_token_ids
from worker.engine.quantize import tensor_bytes
from worker.engine.sampling import Adapter, SampleJob, sample
from worker.model_cache import model_source
from worker.pack_runner import untar

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often an idle sampler looks for requests
GATHER_S = 0.02  # after a first request, how long it waits for more to decode with it
ADAPTERS_KEPT = 32  # adapters kept on the device between batches
WATCH_S = 1.0  # how often the worker looks for a first request, and checks that its sampler process lives


@dataclass(frozen=True)
class SamplerConfig:
    """What the sampler process needs (sent to a spawned process: plain values and module-level callables only)."""

    worker_id: str
    device: str
    make_bus: Callable[[], Bus]
    make_store: Callable[[], LocalArtifactStore]
    model_cache_dir: Path
    max_batch: int = 32  # LORAPLANE_SAMPLER_MAX_BATCH
    max_batch_tokens: int = 65536  # LORAPLANE_SAMPLER_MAX_BATCH_TOKENS: a batch's KV cache positions at most
    idle_s: float = 300.0  # LORAPLANE_SAMPLER_IDLE_S
    cpu_threads: int = 0
    loglevel: str = "INFO"


@dataclass
class _Loaded:
    fields: dict[str, Any]
    model: Any
    tokenizer: Any
    stop_ids: frozenset[int]
    context_tokens: int
    last_used: float


class Sampler:
    """Takes requests off the sampling streams and answers them (the process's loop is `serve`)."""

    def __init__(self, config: SamplerConfig, bus: Bus, store: LocalArtifactStore,
                 on_held: Callable[[int], None] | None = None) -> None:
        self.config, self.bus, self.store = config, bus, store
        self.on_held = on_held  # told `held_bytes()` after each load, batch and unload
        self.device = torch.device(config.device)
        self.availability = ModelAvailability(bus)
        self.loaded: _Loaded | None = None
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.held: list[SampleRequest] = []  # taken, but left to the next batch by the batch's token budget

    def serve(self, stop: Any) -> None:
        """Answers requests until ``stop`` (a ``threading.Event`` or ``multiprocessing.Event``) is set."""
        while not stop.is_set():
            requests = self.take()
            if requests:
                self.answer(requests)
            else:
                self.unload_idle()
                stop.wait(POLL_S)

    def take(self) -> list[SampleRequest]:
        """The requests a batch left over, else up to `max_batch` waiting requests of one model (the warm model's
        first); expired ones dropped."""
        if self.held:
            held, self.held = self.held, []
            return [r for r in held if r.deadline > time.time()]
        names = self.availability.models() or []
        if self.loaded is not None and self.loaded.fields["name"] in names:
            names = [self.loaded.fields["name"], *(n for n in names if n != self.loaded.fields["name"])]
        for name in names:
            stream = sampling_stream(name)
            got = self._consume(stream, self.config.max_batch)
            if not got:
                continue
            if len(got) < self.config.max_batch:
                time.sleep(GATHER_S)  # requests sent together are decoded together
                got += self._consume(stream, self.config.max_batch - len(got))
            now = time.time()
            return [r for r in got if r.deadline > now]
        return []

    def _consume(self, stream: str, count: int) -> list[SampleRequest]:
        messages = self.bus.consume(stream, SAMPLERS_GROUP, self.config.worker_id, count, block_s=0)
        # Acked at once: a sampler that dies mid-answer leaves the request to the API's timeout, never answered twice.
        self.bus.ack(stream, SAMPLERS_GROUP, [msg_id for msg_id, _ in messages])
        parsed = (parse_sample_request(body, on_drop=lambda reason: None) for _, body in messages)
        return [r for r in parsed if r is not None]

    def answer(self, requests: list[SampleRequest]) -> None:
        """Decodes the requests of one base model together and writes every answer; then tells the worker what the
        sampler holds now (a load, a new adapter or a larger KV cache may have grown it)."""
        try:
            self._answer(requests)
        finally:
            self._tell_held()

    def _answer(self, requests: list[SampleRequest]) -> None:
        started = time.time()
        try:
            load_s = self._ensure_model(requests[0].base_model.model_dump())
        except Exception as exc:  # noqa: BLE001 - the model cannot load: every request is told why
            log.exception("sampling: base model %s could not be loaded", requests[0].base_model.name)
            for request in requests:
                self._refuse(request, 503, "model_unavailable", f"The base model could not be loaded: {exc}")
            return
        loaded = self.loaded
        assert loaded is not None
        preparing = time.monotonic()
        prepared = [a for a in (self._prepare(r, loaded) for r in requests) if a is not None]
        fits = batch_fits([(len(a.job.prompt_ids), a.job.max_tokens) for a in prepared], self.config.max_batch_tokens)
        answers = prepared[:fits]
        self.held += [a.request for a in prepared[fits:]]  # the next batch's, first
        load_s += time.monotonic() - preparing  # the adapters' fetch from the store, on a first use
        jobs = [a.job for a in answers]
        try:
            sample(loaded.model, jobs, stop_ids=loaded.stop_ids, pad_token_id=int(loaded.tokenizer.pad_token_id),
                   on_token=lambda index, token: answers[index].on_token())
        except Exception as exc:  # noqa: BLE001 - a failed batch is told to each of its requests
            log.exception("sampling: a batch of %d requests failed", len(answers))
            for a in answers:
                self._refuse(a.request, 503, "sampling_failed", f"Sampling failed on the worker: {exc}")
            return
        loaded.last_used = time.time()
        for a in answers:
            a.finish(queued_s=max(0.0, started - a.request.sent_at), load_s=load_s, batch_requests=len(answers))

    def _prepare(self, request: SampleRequest, loaded: _Loaded) -> _Answer | None:
        """The request's job (its prompt's tokens and adapter), or None when refused (told why)."""
        try:
            adapter = self._adapter(request.adapter_key, loaded) if request.adapter_key else None
        except Exception as exc:  # noqa: BLE001 - an adapter that cannot be read fails this request only
            log.exception("sampling: the adapter of request %s could not be read", request.request_id)
            self._refuse(request, 503, "adapter_unavailable", f"The trial's adapter could not be read: {exc}")
            return None
        try:
            prompt_ids = encode_prompt(loaded.tokenizer, messages=request.messages, prompt=request.prompt)
        except Exception as exc:  # noqa: BLE001 - a conversation the chat template refuses fails this request only
            log.warning("sampling: request %s refused: %s", request.request_id, exc)
            self._refuse(request, 422, "invalid_prompt", f"The prompt could not be encoded for the model: {exc}")
            return None
        if len(prompt_ids) + request.max_tokens > loaded.context_tokens:
            self._refuse(request, 422, "context_length_exceeded",
                         f"The prompt is {len(prompt_ids)} tokens and max_tokens {request.max_tokens}; the model "
                         f"reads at most {loaded.context_tokens} in all.")
            return None
        job = SampleJob(prompt_ids, adapter, max_tokens=request.max_tokens, temperature=request.temperature,
                        top_p=request.top_p, seed=request.seed)
        return _Answer(request, job, loaded.tokenizer, self.bus)

    def held_bytes(self) -> int:
        """The device memory this sampler holds: on CUDA what the caching allocator reserved (its model, adapters and
        the largest KV cache a batch has needed, kept for the next); on a CPU its model's and adapters' tensors."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device))
        if self.loaded is None:
            return 0
        adapters = (t for adapter in self.adapters.values() for pair in adapter.tensors.values() for t in pair)
        return tensor_bytes(self.loaded.model) + sum(t.numel() * t.element_size() for t in adapters)

    def _tell_held(self) -> None:
        if self.on_held is not None:
            self.on_held(self.held_bytes())

    def _ensure_model(self, fields: dict[str, Any]) -> float:
        """Loads the request's base model unless it is the one held; the seconds it took (0 when warm)."""
        if self.loaded is not None and self.loaded.fields == fields:
            return 0.0
        self.unload()
        started = time.monotonic()
        model, tokenizer = load_base_model(model_source(fields), cache_dir=self.config.model_cache_dir,
                                           device=self.device)
        context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.loaded = _Loaded(fields, model, tokenizer, stop_token_ids(model, tokenizer), context, time.time())
        load_s = time.monotonic() - started
        log.info("sampler loaded %s in %.1f s", fields["name"], load_s)
        return load_s

    def _adapter(self, key: str, loaded: _Loaded) -> Adapter:
        adapter = self.adapters.get(key)
        if adapter is None:
            with tempfile.TemporaryDirectory(prefix="sample-adapter-") as tmp:
                config, tensors = read_peft_adapter(untar(self.store, key, Path(tmp)))
            dtype = next(loaded.model.parameters()).dtype
            moved = {p: (a.to(self.device, dtype), b.to(self.device, dtype)) for p, (a, b) in tensors.items()}
            adapter = Adapter(key, config, moved)
            self.adapters[key] = adapter
            while len(self.adapters) > ADAPTERS_KEPT:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(key)
        return adapter

    def _refuse(self, request: SampleRequest, status: int, code: str, message: str) -> None:
        self.bus.publish(sampling_reply_stream(request.request_id), SampleReply(
            request_id=request.request_id, done=True, status=status, error_code=code, error_message=message).to_dict())

    def unload_idle(self) -> None:
        if self.loaded is not None and time.time() - self.loaded.last_used > self.config.idle_s:
            log.info("sampler dropping %s (no request for %.0f s)", self.loaded.fields["name"], self.config.idle_s)
            self.unload()

    def unload(self) -> None:
        self.loaded = None
        self.adapters.clear()  # they are on the base's device, in its dtype
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._tell_held()


def batch_fits(requests: list[tuple[int, int]], budget_tokens: int) -> int:
    """How many of ``requests`` ((prompt tokens, max_tokens) each, in order) one batch decodes: as many as keep its
    KV cache, ``rows x (longest prompt + most new tokens)`` positions (prompts are left-padded to the longest), within
    ``budget_tokens``; always the first."""
    longest_prompt = most_new = 0
    for count, (prompt, new) in enumerate(requests):
        longest_prompt, most_new = max(longest_prompt, prompt), max(most_new, new)
        if count and (count + 1) * (longest_prompt + most_new) > budget_tokens:
            return count
    return len(requests)


class _Answer:
    """One request's answer as it is decoded: its text (cut at a stop string) and, streaming, its pieces sent. Without
    stop strings and streaming, the text is decoded once at the end, not at every token."""

    def __init__(self, request: SampleRequest, job: SampleJob, tokenizer: Any, bus: Bus) -> None:
        self.request, self.job, self.tokenizer, self.bus = request, job, tokenizer, bus
        self.text = ""
        self.sent = 0  # characters of text already sent
        # Streaming, the last characters that might begin a stop string wait until the answer goes past them.
        self.holdback = max((len(s) for s in request.stop), default=1) - 1
        self.per_token = bool(request.stop) or request.stream

    def on_token(self) -> bool:
        """Takes the job's newest token; False when a stop string ended the answer."""
        if not self.per_token:
            return True
        text = self._decoded()
        cuts = [text.find(s) for s in self.request.stop if s and s in text]
        if cuts:
            self.text = text[: min(cuts)]
            return False
        self.text = text
        if self.request.stream:
            ready = len(text) - self.holdback
            while ready > self.sent and text[ready - 1] == "\ufffd":  # half of a character: wait for the rest
                ready -= 1
            if ready > self.sent:
                self._send(text[self.sent : ready])
                self.sent = ready
        return True

    def finish(self, *, queued_s: float, load_s: float, batch_requests: int) -> None:
        if not self.per_token:
            self.text = self._decoded()
        self.bus.publish(sampling_reply_stream(self.request.request_id), SampleReply(
            request_id=self.request.request_id, text=self.text[self.sent:], done=True,
            finish_reason=self.job.finish_reason, prompt_tokens=len(self.job.prompt_ids),
            completion_tokens=len(self.job.tokens), queued_s=round(queued_s, 4), load_s=round(load_s, 4),
            batch_requests=batch_requests).to_dict())

    def _decoded(self) -> str:
        return str(self.tokenizer.decode(self.job.tokens, skip_special_tokens=True))

    def _send(self, text: str) -> None:
        self.bus.publish(sampling_reply_stream(self.request.request_id),
                         SampleReply(request_id=self.request.request_id, text=text).to_dict())


class SamplerProcess:
    """The worker's sampler, a spawned process of its own, started once sampling is asked of a model the worker loads
    (a request on its stream, now or before: `sampling_used`) and started again if it dies. Until then a worker that
    is never asked to sample pays nothing for it: no process, no second torch, no polling of the bus beyond a look
    at each model stream's newest id every `WATCH_S`. The first request waits for the start (in its `queued_s`)."""

    def __init__(self, config: SamplerConfig, entry: Callable[[SamplerConfig, Any, Any], None]) -> None:
        self.config, self._entry = config, entry
        self._ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._process: Any = None
        self._closed = threading.Event()
        # Set by `close`: the process ends its loop (it ignores SIGTERM, as every child of the worker does).
        self._stop = self._ctx.Event()
        self._held = self._ctx.RawValue(ctypes.c_int64, 0)  # the process's `Sampler.held_bytes`, as it last said

    def start(self) -> None:
        threading.Thread(target=self._watch, name="sampler-watch", daemon=True).start()

    def _spawn(self) -> None:
        self._held.value = 0  # a new process holds nothing yet (a dead one's memory is the driver's again)
        self._process = self._ctx.Process(target=self._entry, args=(self.config, self._stop, self._held),
                                          name="loraplane-sampler", daemon=True)
        self._process.start()

    def _watch(self) -> None:
        bus = self.config.make_bus()
        availability = ModelAvailability(bus)
        while not self._closed.wait(WATCH_S):
            if self._process is None:
                try:
                    used = sampling_used(bus, availability.models() or [])
                except Exception:  # noqa: BLE001 - the bus blinked: look again at the next tick
                    log.warning("could not look at the sampling streams", exc_info=True)
                    continue
                if used:
                    log.info("sampling asked of this worker: starting its sampler process")
                    self._spawn()
            elif not self._process.is_alive():
                log.warning("the sampler process ended (exit code %s); starting another", self._process.exitcode)
                self._spawn()

    def held_bytes(self) -> int:
        """The device memory the sampler process holds, as it last said (0: no process, or one that died)."""
        if self._process is None or not self._process.is_alive():
            return 0
        return int(self._held.value)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the sampler: at its next look for requests, or killed after ``timeout_s`` (mid-batch: its requests
        time out on the API's side; nothing else is lost)."""
        self._closed.set()
        self._stop.set()
        if self._process is not None and self._process.is_alive():
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)


def sampling_used(bus: Bus, models: list[str]) -> bool:
    """Whether a sampling request was ever sent for one of ``models`` (its stream has a message)."""
    return any(bus.tail_id(sampling_stream(name)) not in ("0", "0-0") for name in models)
