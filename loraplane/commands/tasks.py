"""`loraplane tasks create|list|show|watch|cancel|download|curves`."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from loraplane.client import Client, Task, Trial
from loraplane.commands.base import (
    UsageError,
    common_options,
    emit,
    guarded,
    hyperparameters,
    loss,
    make_client,
    note,
    out,
    percent,
    size,
    table,
    when,
)
from loraplane.commands.watch import counts_text, outcome, trial_headers, trial_rows, watch

FILE_KEYS = ("training_file", "validation_file")


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` (no dot) as a string; a task spec means the number."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+"
               r"(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def load_spec(source: str) -> tuple[dict[str, Any], Path]:
    """The task spec from a YAML or JSON file (by extension, else by content) or `-` (stdin), and the
    directory its relative paths are relative to."""
    if source == "-":
        text, base, name = sys.stdin.read(), Path.cwd(), "<stdin>"
    else:
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as exc:
            raise UsageError(f"{source}: {exc.strerror or exc}") from exc
        base, name = path.parent, source
    suffix = Path(name).suffix.lower()
    as_json = suffix == ".json" or (suffix not in (".yaml", ".yml") and text.lstrip().startswith("{"))
    try:
        spec = json.loads(text) if as_json else yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader
    except json.JSONDecodeError as exc:
        raise UsageError(f"{name}: line {exc.lineno}: {exc.msg}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise UsageError(f"{name}: {where}{getattr(exc, 'problem', None) or exc}") from exc
    except RecursionError:  # both parsers recurse per level; a task spec nests a few levels
        raise UsageError(f"{name}: nested too deeply to read") from None
    if not isinstance(spec, dict):
        raise UsageError(f"{name}: a task spec is a mapping of the API's task fields, not {type(spec).__name__}")
    return spec, base


def _is_path(value: str) -> bool:
    """A file id is `file-<hex>`; anything with a slash, a leading dot or tilde, or an extension is a path."""
    return "/" in value or "\\" in value or value.startswith((".", "~")) or bool(Path(value).suffix)


def upload_local_files(lp: Client, spec: dict[str, Any], base: Path) -> dict[str, Any]:
    """`training_file` / `validation_file` given as local paths are uploaded and replaced by their ids."""
    spec = dict(spec)
    for key in FILE_KEYS:
        value = spec.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base / path
        if path.is_file():
            spec[key] = _uploaded(lp, path, value)
        elif _is_path(value):
            raise UsageError(f"{key}: no such file: {path} (give a local path or a file id)")
    return spec


def _uploaded(lp: Client, path: Path, shown: str) -> str:
    """The id of a file of this tenant with `path`'s content: one uploaded before (same SHA-256), else uploaded now.
    Creating the same task spec again reuses its dataset instead of storing another copy."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise UsageError(f"{shown}: {exc.strerror or exc}") from exc
    same = lp.files.list(sha256=digest.hexdigest(), limit=1).data
    if same:
        note(f"reusing {same[0].id} for {shown} (uploaded before as {same[0].filename}, same content)")
        return same[0].id
    uploaded = lp.files.upload(path)
    note(f"uploaded {shown} as {uploaded.id} ({uploaded.rows} rows, {uploaded.format})")
    return uploaded.id


def cmd_create(args: argparse.Namespace) -> int:
    spec, base = load_spec(args.spec)
    with make_client(args) as lp:
        spec = upload_local_files(lp, spec, base)
        task = lp.tasks.create(spec, idempotency_key=args.idempotency_key)
        if args.watch:
            if not args.json:
                out(f"{task.id} {task.state}: {task.trial_counts.total} trials")
            return watch(lp, task.id, as_json=args.json)
    if args.json:
        emit(task.raw)
    else:
        out(f"{task.id} {task.state}: {task.trial_counts.total} trials of {task.base_model} on {task.training_file}")
        out(f"follow it: loraplane tasks watch {task.id}")
    return 0


def _tasks_table(tasks: list[Task]) -> str:
    rows = []
    for t in tasks:
        c = t.trial_counts
        done = c.completed + c.stopped_early + c.failed + c.cancelled
        best = loss(t.best_trial.best_val_loss) if t.best_trial else "-"
        rows.append([t.id, t.state, percent(t.progress), f"{done}/{c.total}", best, t.base_model, when(t.created_at)])
    return table(["ID", "STATE", "PROGRESS", "TRIALS", "BEST VAL", "MODEL", "CREATED"], rows, right=(2, 3, 4))


def cmd_list(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        tasks = lp.tasks.list(state=args.state, limit=args.limit, after=args.after)
    if args.json:
        emit(tasks.raw)
        return 0
    out(_tasks_table(tasks.data) if tasks.data else "No tasks.")
    if tasks.has_more:
        out(f"(more: --after {tasks.next_after})")
    return 0


def by_val_loss(trials: list[Trial]) -> list[Trial]:
    """Lowest best validation loss first; trials without one after them, by index."""
    return sorted(trials, key=lambda t: (t.best_val_loss is None, t.best_val_loss or 0.0, t.index))


def ranked(task: Task, trials: list[Trial]) -> list[Trial]:
    """As the task judges them: by validation loss, or for a scored metric the highest score first (trials
    without one after them), ties by validation loss."""
    trials = by_val_loss(trials)
    if not task.scored:
        return trials
    return sorted(trials, key=lambda t: (t.metric_score is None, -(t.metric_score or 0.0)))  # stable: ties by loss


def evaluation_text(task: Task) -> str:
    evaluation = task.evaluation or {}
    if task.metric == "reward_accuracy":
        return "reward_accuracy of each trial's best adapter on the validation pairs"
    pattern = f" /{evaluation.get('pattern')}/" if task.metric == "regex" else ""
    return (f"{task.metric}{pattern} on the validation rows, up to {evaluation.get('max_new_tokens')} new tokens "
            "per answer")


def objective_text(task: Task) -> str:
    objective = task.objective or {}
    betas = task.search_space.get("beta") or []
    beta = f"beta {', '.join(f'{b:g}' for b in betas)}" if isinstance(betas, list) else "beta searched"
    smoothing = objective.get("label_smoothing") or 0
    return f"dpo ({objective.get('loss', 'sigmoid')} loss{f', label smoothing {smoothing:g}' if smoothing else ''}, " \
           f"{beta})"


def cmd_show(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        task = lp.tasks.get(args.task_id)
        trials = ranked(task, lp.tasks.trials(args.task_id).data)
    if args.json:
        emit({"task": task.raw, "trials": [t.raw for t in trials]})
        return 0
    budget = [f"{k} {getattr(task, k)}" for k in ("epochs", "max_steps") if getattr(task, k) is not None]
    every = "every step" if task.eval_interval == 1 else f"every {task.eval_interval} steps"
    budget += [f"max_seq_len {task.max_seq_len}", f"validated {every}"]
    validation = task.validation_file or f"{task.validation_split or 0.1:g} of the training file"
    policy = task.early_exit.get("policy", "none")
    out(f"{task.id}  {task.state}  {percent(task.progress)}  {task.base_model}")
    details = [
        ("data", f"{task.training_file}, validation: {validation}"),
        ("budget", ", ".join(budget)),
        ("search", f"{task.strategy}, {counts_text(task)}"),
        ("early exit", policy),
        *([("objective", objective_text(task))] if task.dpo else []),
        *([("judged by", evaluation_text(task))] if task.scored else []),
        ("created", when(task.created_at)),
        ("started", when(task.started_at)),
        ("finished", when(task.finished_at)),
    ]
    if task.error:
        details.append(("error", task.error))
    for label, value in details:
        out(f"  {label:<11} {value}")
    out()
    metric = task.scored
    rows = [[*row[:1], trial.id, *row[1:]] for trial, row in zip(trials, trial_rows(trials, metric), strict=True)]
    headers = trial_headers(metric)
    out(table([headers[0], "TRIAL", *headers[1:]], rows, right=(0, 4, 5, 6) if metric else (0, 4, 5)))
    stopped = [t for t in trials if t.stop_reason or t.error]
    for t in stopped:
        out(f"  #{t.index}: {t.stop_reason or ''}{': ' if t.stop_reason and t.error else ''}{t.error or ''}")
    out()
    if task.best_trial is None:
        out(f"best trial: {no_best_trial_text(task)}")
    else:
        out("\n".join(line for line in outcome(task, trials) if not line.startswith(task.id)))
    refit = next((t for t in trials if t.id == task.refit_trial_id), None)
    if refit is not None:
        out(f"refit: trial {refit.index} ({refit.id}), {refit.state}: the best configuration on training + validation "
            f"rows{'; loraplane tasks download --refit ' + task.id if refit.adapter_ready else ''}")
    return 0


def no_best_trial_text(task: Task) -> str:
    """Why a task has no best trial: not yet, or never (a failed task's reason)."""
    if task.state == "failed":
        return f"none: the task failed{f' ({task.error})' if task.error else ''}"
    if task.done:
        return f"none: the task ended ({task.state}) with no completed trial"
    return "none yet"


def cmd_watch(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        return watch(lp, args.task_id, as_json=args.json, timeout=args.timeout, poll_interval=args.poll_interval)


def cmd_cancel(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        task = lp.tasks.cancel(args.task_id)
    if args.json:
        emit(task.raw)
    else:
        out(f"{task.id} {task.state}: {counts_text(task)}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        trial_id = args.trial
        best = None
        if args.refit:
            trial_id = None
        elif trial_id is None:
            best = lp.tasks.get(args.task_id).best_trial
        if args.gguf and (args.refit or args.checkpoint is not None):
            raise UsageError("--gguf gives a trial's own adapter: not with --refit or --checkpoint")
        if args.gguf:
            written = lp.tasks.download_gguf(args.task_id, args.output, trial_id=trial_id)
            if args.json:
                emit({"task_id": args.task_id, "trial_id": trial_id or (best.id if best else None),
                      "file": str(written)})
            else:
                out(f"The adapter as a llama.cpp LoRA GGUF is in {written} (llama-cli -m base.gguf --lora {written})")
            return 0
        directory = lp.tasks.download_adapter(args.task_id, args.output, trial_id=trial_id, refit=args.refit,
                                              merged=args.merged, checkpoint=args.checkpoint)
        if args.refit:
            trial_id = lp.tasks.get(args.task_id).refit_trial_id
    files = sorted(p.name for p in directory.iterdir())
    which = trial_id or (best.id if best else None)
    if args.json:
        emit({"task_id": args.task_id, "trial_id": which, "directory": str(directory), "files": files})
        return 0
    if best is not None:
        what = f"the best trial, {which} (val loss {loss(best.best_val_loss)}, {hyperparameters(best.hyperparameters)})"
    elif args.refit:
        what = f"the refit, {which} (the best configuration on training + validation rows)"
    elif args.checkpoint is not None:
        what = f"trial {which} at step {args.checkpoint}"
    else:
        what = f"trial {which}"
    out(f"The adapter of {what} is in {directory}/: {', '.join(files)}")
    return 0


def cmd_delete_checkpoint(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        deleted = lp.tasks.delete_checkpoint(args.task_id, args.trial_id, args.step)
    if args.json:
        emit(deleted.raw)
    else:
        out(f"Deleted the checkpoint at step {deleted.step} of {deleted.trial_id}.")
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        kept = lp.tasks.checkpoints(args.task_id, args.trial_id).data
    if args.json:
        emit([c.raw for c in kept])
        return 0
    if not kept:
        out(f"Trial {args.trial_id} keeps no checkpoint yet (one comes at its first epoch's end or improvement).")
        return 0
    out(table(["STEP", "EPOCH", "KINDS", "VAL LOSS", "SIZE", "MODEL"],
              [[str(c.step), f"{c.epoch:g}", ",".join(c.kinds) or "-", loss(c.val_loss), size(c.size_bytes), c.model]
               for c in kept]))
    return 0


def cmd_curves(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        curves = lp.tasks.curves(args.task_id)
    text = "".join(json.dumps(c) + "\n" for c in curves)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        if not args.json:
            out(f"{len(curves)} trials' curves written to {args.output} (for `loraplane replay {args.output}`)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = common_options()
    tasks = sub.add_parser("tasks", help="create, follow and inspect tuning tasks")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="COMMAND")

    create = tsub.add_parser(
        "create", parents=[common], help="submit a task from a YAML or JSON spec",
        description="Submits the task spec (the API's task body) from a YAML or JSON file (by extension, else by "
                    "content; `-` reads stdin). training_file and validation_file take a file id or a local path, "
                    "which is uploaded first (relative paths are relative to the spec file).")
    create.add_argument("spec", help="task.yaml, task.json or -")
    create.add_argument("--idempotency-key", metavar="KEY", help="a retried submission returns the first task")
    create.add_argument("--watch", action="store_true", help="then follow it like `tasks watch`")
    create.set_defaults(func=guarded(cmd_create), client=True)

    ls = tsub.add_parser("list", parents=[common], help="your tasks, newest first")
    ls.add_argument("--state", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    ls.add_argument("--limit", type=int, default=None, help="at most this many (API default 20, max 100)")
    ls.add_argument("--after", metavar="TASK_ID", help="the page after this task")
    ls.set_defaults(func=guarded(cmd_list), client=True)

    show = tsub.add_parser("show", parents=[common],
                           help="a task, its trials by validation loss (or its metric), its best trial")
    show.add_argument("task_id")
    show.set_defaults(func=guarded(cmd_show), client=True)

    w = tsub.add_parser("watch", parents=[common], help="follow a task live until it ends (exit 0: it succeeded)")
    w.add_argument("task_id")
    w.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds (exit 5)")
    w.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                   help="seconds between polls when the event stream cannot be used")
    w.set_defaults(func=guarded(cmd_watch), client=True)

    cancel = tsub.add_parser("cancel", parents=[common], help="cancel a queued or running task")
    cancel.add_argument("task_id")
    cancel.set_defaults(func=guarded(cmd_cancel), client=True)

    download = tsub.add_parser("download", parents=[common], help="unpack the best (or a trial's) adapter into a "
                               "directory")
    download.add_argument("task_id")
    which = download.add_mutually_exclusive_group()
    which.add_argument("--trial", metavar="TRIAL_ID", help="this trial's adapter instead of the best one")
    which.add_argument("--refit", action="store_true", help="the refit's adapter (a task submitted with refit: true)")
    form = download.add_mutually_exclusive_group()
    form.add_argument("--merged", action="store_true", help="the base model with the adapter merged in (a Hugging "
                      "Face safetensors directory), built by a worker on the first request: waits for it")
    form.add_argument("--gguf", action="store_true", help="the adapter as a llama.cpp LoRA GGUF file (llama, mistral, "
                      "qwen2 and qwen3 bases), built by a worker on the first request: waits for it")
    download.add_argument("--checkpoint", type=int, metavar="STEP", help="the trial's kept checkpoint at this step "
                          "(with --trial; `loraplane tasks checkpoints` lists them)")
    download.add_argument("-o", "--output", metavar="DIR", help="where (default ./<task>-<trial>-adapter, or "
                          "-merged)")
    download.set_defaults(func=guarded(cmd_download), client=True)

    checkpoints = tsub.add_parser("checkpoints", parents=[common], help="a trial's kept checkpoints (its best, its "
                                  "last and its epochs' ends)")
    checkpoints.add_argument("task_id")
    checkpoints.add_argument("trial_id")
    checkpoints.set_defaults(func=guarded(cmd_checkpoints), client=True)

    forget = tsub.add_parser("delete-checkpoint", parents=[common], help="delete one of a trial's kept checkpoints "
                             "(its bytes count in the tenant's storage quota)")
    forget.add_argument("task_id")
    forget.add_argument("trial_id")
    forget.add_argument("step", type=int)
    forget.set_defaults(func=guarded(cmd_delete_checkpoint), client=True)

    curves = tsub.add_parser("curves", parents=[common], help="every trial's loss curves as JSONL (what "
                             "`loraplane replay` reads)")
    curves.add_argument("task_id")
    curves.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    curves.set_defaults(func=guarded(cmd_curves), client=True)
