"""What every client command shares: the common options, the client, error handling and exit codes, and
plain-text formatting (tables, losses, sizes, durations)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from loraplane.client import APIConnectionError, APIError, Client, ConfigurationError, WaitTimeout

# Exit codes: the same for every client command (documented in `loraplane --help` and the README).
EXIT_OK = 0
EXIT_REFUSED = 1  # the API refused the request (4xx): its message and param are on stderr
EXIT_USAGE = 2  # a bad command line, spec file or local setting; nothing was sent (or could be)
EXIT_UNREACHABLE = 3  # the API cannot be reached, or answered a server error (5xx)
EXIT_TASK = 4  # `tasks watch` (`tasks create --watch`): the task ended failed or cancelled
EXIT_TIMEOUT = 5  # `tasks watch --timeout`: the task is still running
EXIT_INTERRUPTED = 130  # Ctrl-C

EXIT_CODES = """exit codes:
  0    done
  1    the API refused the request (4xx); its message and the offending param are on stderr
  2    usage error: bad arguments, an unreadable spec file, no API key configured
  3    cannot reach the API, or the API failed (5xx)
  4    tasks watch: the task ended failed or cancelled
  5    tasks watch --timeout: the task had not finished
  130  interrupted (Ctrl-C)"""

Command = Callable[[argparse.Namespace], int | None]


class UsageError(Exception):
    """A problem with what the user gave us (a spec file, an argument): exit 2, nothing sent."""


def common_options(admin: bool = False, suppress: bool = False) -> argparse.ArgumentParser:
    """The options every client command takes (a parent parser, so that they go after the command).
    `suppress`: for a nested command whose outer command takes them too (its defaults must not win)."""
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection")
    group.add_argument("--api-url", metavar="URL", **default,
                       help="the API's root (default: $LORAPLANE_API_URL, then `loraplane login`'s config)")
    if admin:
        group.add_argument("--admin-token", metavar="TOKEN", **default,
                           help="the operator's token (default: $LORAPLANE_ADMIN_TOKEN)")
    else:
        group.add_argument("--api-key", metavar="KEY", **default,
                           help="a tenant API key (default: $LORAPLANE_API_KEY, then `loraplane login`'s config)")
    parent.add_argument("--json", action="store_true", **default,
                        help="print the API's objects as JSON instead of text (for scripts)")
    return parent


def make_client(args: argparse.Namespace, admin: bool = False) -> Client:
    """The client for the command's options, environment and config file; a tenant command needs a key."""
    try:
        lp = Client(getattr(args, "api_url", None), getattr(args, "api_key", None),
                    admin_token=getattr(args, "admin_token", None))
    except ValueError as exc:  # an unreadable config file
        raise UsageError(str(exc)) from exc
    if not admin and not lp.api_key:
        lp.close()
        raise UsageError("no API key: run `loraplane login`, set LORAPLANE_API_KEY or give --api-key")
    return lp


def guarded(func: Command) -> Callable[[argparse.Namespace], int]:
    """Runs a command and turns every failure into one line on stderr and its exit code."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args) or EXIT_OK
        except APIError as exc:
            if getattr(args, "json", False):
                emit(exc.body)  # the API's error object, for scripts
            error(exc.describe())
            for line in error_details(exc.error):
                sys.stderr.write(f"  {line}\n")
            return EXIT_UNREACHABLE if exc.is_server_error else EXIT_REFUSED
        except APIConnectionError as exc:
            error(exc.message)
            return EXIT_UNREACHABLE
        except WaitTimeout as exc:
            error(str(exc))
            return EXIT_TIMEOUT
        except (ConfigurationError, UsageError) as exc:
            error(str(exc))
            return EXIT_USAGE
        except KeyboardInterrupt:
            error("interrupted")
            return EXIT_INTERRUPTED

    return run


def error_details(error: dict[str, Any]) -> list[str]:
    """The lines under an error that lists several problems (an upload's bad rows, a body's invalid fields): every
    one the API returned, then how many more it counted. None for a single problem: the message says it."""
    items = error.get("errors")
    if not isinstance(items, list) or len(items) < 2:
        return []
    lines = []
    for item in items:
        if not isinstance(item, dict):
            continue
        where = f"line {item['line']}" if item.get("line") else item.get("param")
        lines.append(f"{where}: {item.get('message')}" if where else str(item.get("message")))
    total = error.get("error_count")
    if isinstance(total, int) and total > len(items):
        lines.append(f"... and {total - len(items)} more")
    return lines


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    sys.stderr.write(f"loraplane: error: {message}\n")
    sys.stderr.flush()


def note(message: str) -> None:
    """Progress for a human (an upload before a task): stderr, so that stdout stays the command's result."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def emit(obj: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- text formatting ---------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Columns two spaces apart; `right` lists the columns aligned right (numbers)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return "\n".join(line(row) for row in cells)


def loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def score(value: float | None) -> str:
    """A metric score (the share of validation rows that passed)."""
    return "-" if value is None else f"{value:.3f}"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"  # pragma: no cover - the loop returns


def when(value: datetime | None) -> str:
    """Local time, to the second."""
    return "-" if value is None else value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def percent(progress: float) -> str:
    return f"{100 * progress:.0f}%"


_SHORT = {"learning_rate": "lr", "lora_rank": "rank", "lora_alpha": "alpha", "batch_size": "batch",
          "lora_dropout": "dropout", "target_modules": "modules"}


def hyperparameters(hp: dict[str, Any]) -> str:
    """`lr=0.001 rank=8 alpha=16 batch=4 dropout=0 modules=q,v` (module names without `_proj`)."""
    parts = []
    for key, value in hp.items():
        if isinstance(value, list):
            value = ",".join(str(v).removesuffix("_proj") for v in value)
        elif isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{_SHORT.get(key, key)}={value}")
    return " ".join(parts)
