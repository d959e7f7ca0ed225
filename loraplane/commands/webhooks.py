"""`loraplane webhooks add|list|remove|deliveries`: endpoints the service POSTs your task outcomes to."""

from __future__ import annotations

import argparse

from loraplane.commands.base import common_options, emit, guarded, make_client, out, table, when

EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "trial.completed")


def cmd_add(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        hook = lp.webhooks.create(args.url, events=args.event, description=args.description)
    if args.json:
        emit(hook.raw)
        return 0
    out(f"Created {hook.id} for {', '.join(hook.events)}. Its signing secret, shown only this once:\n\n"
        f"    {hook.secret}\n")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        hooks = lp.webhooks.list()
    if args.json:
        emit(hooks.raw)
        return 0
    rows = [[h.id, h.url, ", ".join(h.events), h.description or "-", when(h.created_at)] for h in hooks.data]
    out(table(["ID", "URL", "EVENTS", "DESCRIPTION", "CREATED"], rows) if rows else "No webhooks.")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        deleted = lp.webhooks.delete(args.webhook_id)
    if args.json:
        emit(deleted.raw)
    else:
        out(f"Removed {deleted.id}.")
    return 0


def cmd_deliveries(args: argparse.Namespace) -> int:
    with make_client(args) as lp:
        deliveries = lp.webhooks.deliveries(args.webhook_id, limit=args.limit)
    if args.json:
        emit(deliveries.raw)
        return 0
    rows = [[d.id, d.event_type, d.state, d.attempts, d.last_status_code or "-", d.last_error or "-",
             when(d.next_attempt_at) if d.next_attempt_at else "-", when(d.created_at)] for d in deliveries.data]
    out(table(["ID", "EVENT", "STATE", "ATTEMPTS", "LAST STATUS", "LAST ERROR", "NEXT TRY", "CREATED"], rows,
              right=(3,)) if rows else "No deliveries.")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = common_options()
    hooks = sub.add_parser("webhooks", help="endpoints the service POSTs your task outcomes to (signed)")
    hsub = hooks.add_subparsers(dest="webhooks_command", required=True, metavar="COMMAND")
    add = hsub.add_parser("add", parents=[common], help="register an endpoint (its secret is shown once)")
    add.add_argument("url")
    add.add_argument("--event", action="append", choices=EVENTS, help="an event to send; repeat (default: all)")
    add.add_argument("--description")
    add.set_defaults(func=guarded(cmd_add), client=True)
    hsub.add_parser("list", parents=[common], help="your endpoints").set_defaults(func=guarded(cmd_list), client=True)
    remove = hsub.add_parser("remove", parents=[common], help="remove an endpoint and its delivery log")
    remove.add_argument("webhook_id")
    remove.set_defaults(func=guarded(cmd_remove), client=True)
    log = hsub.add_parser("deliveries", parents=[common], help="an endpoint's deliveries, newest first")
    log.add_argument("webhook_id")
    log.add_argument("--limit", type=int, default=None, help="at most this many (API default 20, max 100)")
    log.set_defaults(func=guarded(cmd_deliveries), client=True)
