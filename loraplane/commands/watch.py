"""`loraplane tasks watch`: a task's live progress until it ends.

On a terminal, a block redrawn in place: the task's progress bar and counts, why its pending trials wait (if
they do: the task's `waiting` field), a compact trials table and the last event. Elsewhere (a pipe, CI logs),
plain lines: one per event (`task.waiting` says why it waits, when that changes), a progress line when it moved.
With `--json`, one line per event (the API's event objects), then the final task object. Either way the
command ends with the task's outcome and exits 0 only when it succeeded.

The events come from `Tasks.iter_events` (the SSE stream, or polling when the stream cannot be used) in a
thread; the main thread redraws from the task and its trials on every event and at least every second,
since training steps move the progress without producing events.
"""

from __future__ import annotations

import queue
import shutil
import sys
import threading
import time
from typing import IO, Any

from loraplane.client import Client, Event, Task, Trial
from loraplane.commands.base import (
    EXIT_OK,
    EXIT_TASK,
    duration,
    emit,
    hyperparameters,
    loss,
    percent,
    score,
    table,
)

REFRESH_S = 1.0  # the terminal view's redraw period without events
LINE_PROGRESS_S = 10.0  # plain lines: a progress line at most this often
_END = object()


def watch(lp: Client, task_id: str, *, as_json: bool = False, timeout: float | None = None,
          poll_interval: float = 1.0, stream: IO[str] | None = None) -> int:
    """Follows the task to its end; returns the exit code (0 succeeded, EXIT_TASK failed or cancelled)."""
    stream = stream or sys.stdout
    task = lp.tasks.get(task_id)  # an unknown id fails here, before any output
    view: _View = _JsonView(stream) if as_json else _LiveView(stream) if stream.isatty() else _LineView(stream)
    inbox: queue.Queue[Any] = queue.Queue()
    follower = threading.Thread(target=_follow, args=(lp, task_id, timeout, poll_interval, inbox), daemon=True,
                                name=f"watch-{task_id}")
    follower.start()
    trials = lp.tasks.trials(task_id).data if view.wants_trials else []
    view.draw(task, trials)
    ended = False
    try:
        while not ended:
            items = _drain(inbox, REFRESH_S)
            for item in items:
                if item is _END:
                    ended = True
                elif isinstance(item, BaseException):
                    raise item
                else:
                    view.event(item)
            if items or view.redraws_on_timer:
                task = lp.tasks.get(task_id)
                trials = lp.tasks.trials(task_id).data if view.wants_trials else []
                view.draw(task, trials)
        task = lp.tasks.get(task_id)
        trials = lp.tasks.trials(task_id).data
        view.draw(task, trials if view.wants_trials else [])
    finally:
        view.close()
    view.final(task, trials)
    return EXIT_OK if task.state == "succeeded" else EXIT_TASK


def _follow(lp: Client, task_id: str, timeout: float | None, poll_interval: float, inbox: queue.Queue[Any]) -> None:
    # Its own connection pool: the main thread keeps polling the task meanwhile.
    try:
        with Client(lp.base_url, lp.api_key, timeout=lp.timeout.read or 30.0) as own:
            for event in own.tasks.iter_events(task_id, timeout=timeout, poll_interval=poll_interval):
                inbox.put(event)
        inbox.put(_END)
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
        inbox.put(exc)


def _drain(inbox: queue.Queue[Any], wait_s: float) -> list[Any]:
    """Whatever arrived within `wait_s` (at least one item, or none after the wait)."""
    try:
        items = [inbox.get(timeout=wait_s)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def counts_text(task: Task) -> str:
    counts = task.trial_counts
    parts = [f"{getattr(counts, name)} {name.replace('_', ' ')}" for name in
             ("running", "waiting", "pending", "completed", "stopped_early", "failed", "cancelled")
             if getattr(counts, name)]
    return ", ".join(parts) or "no trials"


def waiting_text(task: Task, prefix: str = "") -> str:
    """Why its pending trials wait, when they do (the scheduler's `waiting` field): "3 trials waiting behind pack
    ...; 1st in queue; starts in about 3 min"."""
    return f"{prefix}{task.waiting.message}" if task.waiting else ""


def outcome(task: Task, trials: list[Trial]) -> list[str]:
    """The closing lines: how the task ended and its best trial."""
    took = ""
    if task.started_at and task.finished_at:
        took = f" in {duration((task.finished_at - task.started_at).total_seconds())}"
    if task.state == "succeeded":
        lines = [f"{task.id} succeeded{took}: {counts_text(task)}."]
    elif task.state == "failed":
        lines = [f"{task.id} failed{took}: {task.error or counts_text(task)}"]
    elif task.state == "cancelled":
        lines = [f"{task.id} was cancelled: {counts_text(task)}."]
    else:
        lines = [f"{task.id} is {task.state} ({percent(task.progress)}): {counts_text(task)}."]
    best = task.best_trial
    if best is not None:
        index = next((t.index for t in trials if t.id == best.id), None)
        at = f" at step {best.best_step}" if best.best_step is not None else ""
        scored = f"  {task.metric} {score(best.metric_score)}" if task.scored else ""
        lines.append(f"best trial: {best.id}" + (f" (#{index})" if index is not None else "") + scored
                     + f"  val loss {loss(best.best_val_loss)}{at}  {hyperparameters(best.hyperparameters)}")
        lines.append(f"download it: loraplane tasks download {task.id}")
    return lines


def trial_rows(trials: list[Trial], metric: bool = False) -> list[list[Any]]:
    """`metric`: with the METRIC column (a task judged by a generative metric)."""
    return [[t.index, t.state, f"{t.steps_done}/{t.total_steps}", loss(t.last_train_loss), loss(t.best_val_loss),
             *([score(t.metric_score)] if metric else []), hyperparameters(t.hyperparameters)] for t in trials]


TRIAL_HEADERS = ["#", "STATE", "STEPS", "TRAIN", "BEST VAL", "HYPERPARAMETERS"]


def trial_headers(metric: bool = False) -> list[str]:
    return [*TRIAL_HEADERS[:-1], "METRIC", TRIAL_HEADERS[-1]] if metric else list(TRIAL_HEADERS)


class _View:
    wants_trials = False
    redraws_on_timer = False

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def event(self, event: Event) -> None: ...

    def draw(self, task: Task, trials: list[Trial]) -> None: ...

    def close(self) -> None: ...

    def final(self, task: Task, trials: list[Trial]) -> None:
        self.write("\n".join(outcome(task, trials)) + "\n")


class _JsonView(_View):
    def event(self, event: Event) -> None:
        emit(event.raw)

    def final(self, task: Task, trials: list[Trial]) -> None:
        emit(task.raw)


class _LineView(_View):
    """For logs: one line per event, and the progress when it moved (at most every LINE_PROGRESS_S)."""

    redraws_on_timer = True

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self.shown = ""
        self.shown_at = 0.0

    def event(self, event: Event) -> None:
        self.write(f"{event.created_at.astimezone().strftime('%H:%M:%S')}  {event.type:<20} {event.message}\n")

    def draw(self, task: Task, trials: list[Trial]) -> None:
        if task.done:
            return  # the closing lines say how it ended
        line = f"{task.id} {task.state} {percent(task.progress)} ({counts_text(task)})" + waiting_text(task, "; ")
        now = time.monotonic()
        if line != self.shown and (now - self.shown_at >= LINE_PROGRESS_S or not self.shown):
            self.write(line + "\n")
            self.shown, self.shown_at = line, now


class _LiveView(_View):
    """A block redrawn in place (ANSI: cursor up, clear below), cut to the terminal's width and height."""

    wants_trials = True
    redraws_on_timer = True

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self.lines = 0
        self.last_event = ""
        utf = (getattr(stream, "encoding", "") or "").lower().replace("-", "") == "utf8"
        self.full, self.empty = ("█", "░") if utf else ("#", "-")
        self.write("\x1b[?25l")  # hide the cursor while redrawing

    def event(self, event: Event) -> None:
        self.last_event = f"{event.type}: {event.message}"

    def draw(self, task: Task, trials: list[Trial]) -> None:
        width, height = shutil.get_terminal_size((100, 30))
        filled = round(task.progress * 24)
        eta = task.estimated_seconds_left
        head = (f"{task.id}  {task.state}  [{self.full * filled}{self.empty * (24 - filled)}] "
                f"{percent(task.progress):>4}  {counts_text(task)}" + (f"  ETA {duration(eta)}" if eta else ""))
        room = max(1, height - 5)
        shown = trials[:room]
        metric = task.scored
        body = (table(trial_headers(metric), trial_rows(shown, metric), right=(0, 3, 4, 5) if metric else (0, 3, 4))
                .splitlines() if trials else [])
        if len(trials) > room:
            body.append(f"... and {len(trials) - room} more trials")
        block = [head, *([waiting_text(task)] if task.waiting else []), *body] + (
            [self.last_event] if self.last_event else [])
        text = "".join(line[:width - 1] + "\n" for line in block)
        up = f"\x1b[{self.lines}F" if self.lines else ""
        self.write(f"{up}\x1b[J{text}")
        self.lines = len(block)

    def close(self) -> None:
        self.write("\x1b[?25h")  # the cursor back
