"""Webhook egress in tests: the name-resolution seam, and the operator's allow-list for loopback receivers.

This machine has no DNS, and no test may send anything (a DNS query included) to an address that is not loopback.
So where a test needs a host NAME to resolve, the check (common/egress.py) is given `TableResolver`: it answers
names from its table as a DNS server would, and numeric forms (127.1, 0x7f000001, ::1) through the system's own
getaddrinfo with AI_NUMERICHOST (libc parses them; no lookup is made); any other name does not resolve. It is the
one stand-in: the HTTP receivers, the sender, the API and the database are real.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from common.egress import normal_host
from common.settings import get_settings

ALLOW_SETTING = "LORAPLANE_WEBHOOK_ALLOWED_NETWORKS"
# A public address that names resolve to at registration. Never connected to: registration resolves and checks
# but connects nowhere, and the tests that send move the name to loopback (or use an address literal) first.
PUBLIC_ADDRESS = "93.184.215.14"


class TableResolver:
    """A `Resolver` (host, port -> addresses) answering from `names`, which a test may change between calls (a DNS
    record that changes: rebinding). Records every host it was asked about in `asked`."""

    def __init__(self, names: dict[str, list[str]] | None = None) -> None:
        self.names: dict[str, list[str]] = {
            "localhost": ["127.0.0.1", "::1"],  # as /etc/hosts has it
            "example.com": [PUBLIC_ADDRESS],
            "metadata.google.internal": ["169.254.169.254"],  # what it resolves to inside a cloud
            **(names or {}),
        }
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if (answer := self.names.get(normal_host(host))) is not None:
            return list(answer)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return [str(info[4][0]) for info in infos]


@contextmanager
def allowed_networks(value: str) -> Iterator[None]:
    """The operator's LORAPLANE_WEBHOOK_ALLOWED_NETWORKS set to `value` for the block, through the environment and
    the settings as a process reads them (restored, and the settings read again, after)."""
    before = os.environ.get(ALLOW_SETTING)
    os.environ[ALLOW_SETTING] = value
    get_settings.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ALLOW_SETTING, None)
        else:
            os.environ[ALLOW_SETTING] = before
        get_settings.cache_clear()
