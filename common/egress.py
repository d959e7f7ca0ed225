"""Outbound requests that cannot be aimed inward: which addresses a tenant-given URL may reach.

A webhook URL is the one place a tenant makes this service open a connection. Left unchecked, a URL to
127.0.0.1, 10.x or 169.254.169.254 (a cloud's metadata service) turns the sender into the tenant's probe of our
own network. The rule: only public addresses, plus what the operator allows (`LORAPLANE_WEBHOOK_ALLOWED_NETWORKS`).

The pure parts come first: `inward_reason` (why an address is not public), `EgressPolicy` (the operator's
allow-list), `refusal` (both together) and `authority_refusal` (a URL whose host parsers may read differently).
`Egress.target` is the thin shell around them: it resolves a URL's host in a thread with a time limit and checks
EVERY address, so a name with one public and one inward address is refused. The caller then connects to one of
the checked addresses itself (scheduler/service/webhooks.py), never to a second resolution of the name: a DNS answer
that changes between the check and the connection (rebinding) cannot aim the connection inward.

Name resolution is a seam: `Resolver`, `system_resolver` (getaddrinfo) by default. Tests on a machine without DNS
pass a function that answers as a DNS server would (tests/egress.py); everything else they run is real.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# host, port -> the addresses it resolves to (as getaddrinfo gives them); raises OSError when it does not resolve.
Resolver = Callable[[str, int], Sequence[str]]

# One lookup's limit: a registration waits for it, so a name whose DNS server never answers must not hold the
# request (getaddrinfo has no timeout of its own and cannot be cancelled: the lookup is left to finish in its
# thread, and its answer is dropped).
RESOLVE_TIMEOUT_S = 3.0
# Threads that run lookups, shared by the process: slow lookups queue behind each other (and time out) rather
# than each taking a thread of its own.
RESOLVER_THREADS = 8

SHARED_ADDRESS_SPACE = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d (RFC 4291), and :: and ::1
NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))  # RFC 6052, RFC 8215


def _reason_v4(ip: ipaddress.IPv4Address) -> str | None:
    checks = (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
              ("multicast", ip.is_multicast), ("shared address space", ip in SHARED_ADDRESS_SPACE),
              ("reserved", ip.is_reserved), ("private", ip.is_private), ("not global", not ip.is_global))
    return next((name for name, hit in checks if hit), None)


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses a packet to `ip` may end up at: IPv4-mapped, NAT64, 6to4, and Teredo's server and client."""
    found = [ip.ipv4_mapped] if ip.ipv4_mapped else []
    if any(ip in net for net in NAT64):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.sixtofour:
        found.append(ip.sixtofour)
    if ip.teredo:
        found.extend(ip.teredo)
    return found


def _reason_v6(ip: ipaddress.IPv6Address) -> str | None:
    embedded = _embedded_v4(ip)
    for v4 in embedded:
        if reason := _reason_v4(v4):
            return f"embeds {v4} ({reason})"
    if ip.ipv4_mapped or any(ip in net for net in NAT64):
        return None  # a translation to a public IPv4 address: judged by that address alone (above)
    checks = (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
              ("IPv4-compatible", ip in IPV4_COMPATIBLE), ("link-local", ip.is_link_local),
              ("site-local", ip.is_site_local), ("multicast", ip.is_multicast), ("reserved", ip.is_reserved),
              ("private", ip.is_private), ("not global", not ip.is_global))
    return next((name for name, hit in checks if hit), None)


def inward_reason(ip: IPAddress) -> str | None:
    """Why `ip` is not a public address (loopback, private, link-local, ...), for the operator's log; None: public.
    `ipaddress`'s own `is_global` alone is not enough: it calls multicast, 6to4 to 10.x and ::127.0.0.1 global."""
    return _reason_v4(ip) if isinstance(ip, ipaddress.IPv4Address) else _reason_v6(ip)


def normal_host(host: str) -> str:
    """A host name as the allow-list compares it: lower case, without the root's trailing dot."""
    return host.lower().rstrip(".")


@dataclass(frozen=True)
class EgressPolicy:
    """The operator's exceptions: networks, and host names whatever they resolve to, that may be reached although
    they are not public (an in-cluster receiver; the tests' loopback receivers)."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> EgressPolicy:
        """`LORAPLANE_WEBHOOK_ALLOWED_NETWORKS`: comma-separated CIDRs, addresses and host names (empty: none).
        Raises ValueError naming the entry that is none of them."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = normal_host(entry)
            labels = name.split(".")
            if not all(label and len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()
                       for label in labels) or name.replace(".", "").isdigit():
                raise ValueError(f"{entry!r} is neither a network (CIDR), an address nor a host name")
            hosts.add(name)
        return cls(networks=tuple(networks), hosts=frozenset(hosts))

    def allows(self, host: str, ip: IPAddress) -> bool:
        if normal_host(host) in self.hosts:
            return True
        candidates: list[IPAddress] = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            candidates.append(ip.ipv4_mapped)  # ::ffff:127.0.0.1 is 127.0.0.1 on a dual-stack socket
        return any(c.version == net.version and c in net for c in candidates for net in self.networks)


def refusal(policy: EgressPolicy, host: str, ip: IPAddress) -> str | None:
    """Why `ip` (an address of `host`) may not be reached; None: it may."""
    if policy.allows(host, ip):
        return None
    return inward_reason(ip)


def authority_refusal(url: str) -> str | None:
    """What in the URL's authority (user, password, host and port: from `//` to the path) makes it ambiguous, or
    None. A backslash or a percent-escape there is refused: URL parsers disagree on where such a host ends (WHATWG's,
    in browsers and many clients, reads `\\` as `/`; one that decodes before it splits reads `%2f` as `/` and `%40`
    as `@`), so `https://a.example\\@b.example/` is b.example to this service and a.example to others. Only a
    plain authority reads the same to every parser. A host never needs an escape (letters, digits, dots, hyphens or
    an address; an international name has its `xn--` form); a user name or password that does cannot be given in the
    URL (deliveries are signed, and a tracker's token has a field of its own). The authority checked is
    `urlsplit`'s, which runs to the first `/`, `?` or `#`: it holds every other parser's (WHATWG's also stops at a
    backslash), so nothing another parser takes for the authority goes unchecked."""
    try:
        authority = urlsplit(url).netloc
    except ValueError:
        return None  # not a URL: the caller's own parse refuses it
    if "\\" in authority:
        return "a backslash ('\\')"
    if "%" in authority:
        return "a percent-escape ('%')"
    return None


class EgressRefused(Exception):
    """A URL this service will not send to. `code`: what the tenant may be told (`url_not_allowed`,
    `url_unresolvable`); the message: the detail (resolved addresses), for the operator's log only."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


NOT_ALLOWED = "url_not_allowed"
UNRESOLVABLE = "url_unresolvable"


@dataclass(frozen=True)
class Target:
    """Where a URL may be sent: its host and port, and the addresses of the host, each one checked."""

    url: httpx.URL
    host: str  # as sent in Host and TLS's SNI: the URL's ASCII (IDNA) host
    port: int
    addresses: tuple[IPAddress, ...]


def system_resolver(host: str, port: int) -> list[str]:
    """The system's resolver: /etc/hosts, DNS, and numeric forms such as 127.1 or 0x7f000001 (inet_aton's)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


_lookups = concurrent.futures.ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="resolve")


def _parse_address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def default_port(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


@dataclass(frozen=True)
class Egress:
    """The check with its parts: the operator's policy, the resolver (the seam) and the lookup's time limit."""

    policy: EgressPolicy = field(default_factory=EgressPolicy)
    resolver: Resolver = system_resolver
    timeout_s: float = RESOLVE_TIMEOUT_S
    # The threads the lookups run in: the process's shared pool, or one of the caller's own (the sender keeps its
    # lookups apart from registrations', which tenants can send many of, in `loraplane up`'s single process).
    lookups: concurrent.futures.Executor = _lookups

    def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The host's addresses: an address literal as it is, a name through the resolver in a thread, within
        `timeout_s`. Raises EgressRefused(UNRESOLVABLE) for no answer, an error, or no answer in time."""
        literal = _parse_address(host)
        if literal is not None:
            return [literal]
        try:
            answer = self.lookups.submit(self.resolver, host, port).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise EgressRefused(UNRESOLVABLE, f"resolving {host!r} took over {self.timeout_s:g} s") from None
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            raise EgressRefused(UNRESOLVABLE, f"resolving {host!r} failed: {exc}") from None
        addresses = [a for a in (_parse_address(text) for text in answer) if a is not None]
        if not addresses or len(addresses) != len(answer):
            raise EgressRefused(UNRESOLVABLE, f"resolving {host!r} gave no usable address: {list(answer)}")
        return list(dict.fromkeys(addresses))  # in the resolver's order (its preference), each once

    def target(self, url: str) -> Target:
        """Resolves the URL's host and checks every address; raises EgressRefused when one may not be reached
        (one inward address refuses the whole name: which one a later connection would get is not ours to pick)
        or the host does not resolve. The URL is expected to be a valid http(s) URL with a host."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:  # registration refuses these first; a row from elsewhere is refused here
            raise EgressRefused(NOT_ALLOWED, f"not a valid URL: {exc}") from None
        if (ambiguous := authority_refusal(url)) is not None:  # a row stored before registration refused these
            raise EgressRefused(NOT_ALLOWED, f"the URL's authority holds {ambiguous}")
        host = parsed.raw_host.decode("ascii")
        port = default_port(parsed)
        addresses = self.resolve(host, port)
        refused = [(ip, why) for ip in addresses if (why := refusal(self.policy, host, ip)) is not None]
        if refused:
            listed = ", ".join(f"{ip} ({why})" for ip, why in refused)
            raise EgressRefused(NOT_ALLOWED, f"{host!r} resolves to addresses that are not public: {listed}")
        return Target(url=parsed, host=host, port=port, addresses=tuple(addresses))
