"""The client and the CLI report why a queued task waits: the real API over HTTP and the real scheduler daemon (on
the test's Postgres and Redis; we play the worker by publishing its reports, as tests/scheduler/test_daemon.py
does). Task A on one model occupies the only worker; task B, on another model, waits behind A's pack: `tasks.wait`
hands its `task.waiting` event to `on_event`, the typed `Task.waiting` says why, and `tasks watch` prints it."""

from __future__ import annotations

import io
import threading

from common.celery import worker_queue
from common.settings import get_settings
from loraplane.client import Client, Event, TaskWaiting
from loraplane.commands.watch import _LineView
from tests.factories import TenantKey, chat_rows, task_body
from tests.scheduler.test_daemon import WORKER, fresh_daemon, heartbeat, live_pack, report
from tests.scheduler.test_model_availability import SMOL, TINY, age_models


class Seen(Exception):
    """Ends the wait once the event the test waits for arrived (the task itself would wait for ever)."""


def test_wait_and_watch_report_why_a_task_waits_behind_another_models_pack(api_url: str, tenant: TenantKey) -> None:
    age_models(SMOL, TINY)
    daemon = fresh_daemon(WORKER)
    with Client(api_url, tenant.key) as lp:
        f = lp.files.upload(chat_rows(), filename="train.jsonl")
        lp.tasks.create(task_body(f.id, max_steps=4, epochs=None))
        heartbeat()
        daemon.step(block_s=0.2)
        pack = live_pack()
        b = lp.tasks.create(task_body(f.id, base_model=SMOL, max_steps=4, epochs=None))
        assert b.waiting is None  # not judged yet

        stop = threading.Event()

        def rounds() -> None:  # the scheduler goes on while the client waits
            while not stop.is_set():
                report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8,
                       pack_id=pack.id)
                daemon.step(block_s=0.2)

        seen: list[Event] = []

        def on_event(event: Event) -> None:
            seen.append(event)
            if event.type == "task.waiting":
                raise Seen

        scheduler = threading.Thread(target=rounds, daemon=True)
        scheduler.start()
        try:
            try:
                lp.tasks.wait(b.id, timeout=120, on_event=on_event)
            except Seen:
                pass
        finally:
            stop.set()
            scheduler.join()
        assert [e.type for e in seen] == ["task.created", "task.small_validation", "task.waiting"]
        told = seen[-1]
        assert told.message.startswith(f"4 trials waiting behind pack {pack.id} on worker {WORKER}")
        assert "1st in queue; starts in" in told.message
        task = lp.tasks.get(b.id)
        assert isinstance(task.waiting, TaskWaiting)
        assert (task.waiting.reason, task.waiting.position, task.waiting.pack_id) == ("behind_pack", 1, pack.id)
        assert task.waiting.estimated_start_at is not None and task.waiting.message == told.message

        out = io.StringIO()
        view = _LineView(out)
        view.event(told)
        view.draw(task, [])
        lines = out.getvalue().splitlines()
        assert "task.waiting" in lines[0] and told.message in lines[0]
        assert lines[1] == f"{b.id} queued 0% (4 pending); {told.message}"
