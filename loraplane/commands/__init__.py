"""The client commands of `loraplane` (login, files, models, tasks, sample, admin), on `loraplane.client`.

Each command prints text for people, or with `--json` exactly the API's objects; failures are one line on
stderr and an exit code from `base.EXIT_CODES`.
"""

from __future__ import annotations

import argparse

from loraplane.commands import admin, files, sample, tasks, usage, webhooks
from loraplane.commands.base import EXIT_CODES

__all__ = ["EXIT_CODES", "register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    files.register(sub)  # login, files, models
    tasks.register(sub)
    sample.register(sub)  # loraplane sample
    admin.register(sub)
    usage.register(sub)
    webhooks.register(sub)
