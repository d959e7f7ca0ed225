"""`loraplane usage`: what your tasks took (GPU seconds, tokens), how trials ended, what you store."""

from __future__ import annotations

import argparse

from loraplane.client import Usage
from loraplane.commands.base import common_options, emit, guarded, make_client, out, size, table


def window_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="start", metavar="TIME", help="window start, ISO 8601 (no zone: UTC)")
    parser.add_argument("--to", dest="end", metavar="TIME", help="window end (default now)")


def usage_table(rows: list[Usage], names: dict[str, str] | None = None) -> str:
    names = names or {}
    cells = [[names.get(u.tenant_id, u.tenant_id), f"{u.gpu_seconds / 3600:.3f}", f"{u.gpu_seconds:.1f}", u.tokens,
              ", ".join(f"{n} {state}" for state, n in sorted(u.trials.items())) or "-", size(u.storage_bytes)]
             for u in rows]
    return table(["TENANT", "GPU HOURS", "GPU SECONDS", "TOKENS", "TRIALS", "STORAGE"], cells, right=(1, 2, 3, 5))


def cmd_usage(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        usage = lp.usage(start=args.start, end=args.end)
    if args.json:
        emit(usage.raw)
        return 0
    out(usage_table([usage]))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = sub.add_parser("usage", parents=[common_options()], help="your GPU time, tokens, trials and storage")
    window_options(usage)
    usage.set_defaults(func=guarded(cmd_usage), client=True)
