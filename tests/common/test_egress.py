"""common/egress.py: which addresses a webhook may reach, the operator's allow-list, and resolution within a time
limit with every address checked. Pure or near-pure: nothing here opens a connection or sends a DNS query."""

from __future__ import annotations

import ipaddress
import threading
import time

import pytest

from common.egress import (
    NOT_ALLOWED,
    UNRESOLVABLE,
    Egress,
    EgressPolicy,
    EgressRefused,
    authority_refusal,
    inward_reason,
    refusal,
    system_resolver,
)
from tests.egress import PUBLIC_ADDRESS, TableResolver

INWARD = [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("10.0.0.1", "private"), ("172.16.0.1", "private"),
    ("172.31.255.254", "private"), ("192.168.1.1", "private"), ("169.254.169.254", "link-local"),
    ("100.64.0.1", "shared address space"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("192.0.2.1", "private"), ("198.18.0.1", "private"), ("0.1.2.3", "private"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fc00::1", "private"),
    ("fd12:3456::1", "private"), ("fec0::1", "site-local"), ("ff02::1", "multicast"), ("ff0e::1", "multicast"),
    ("::ffff:127.0.0.1", "embeds 127.0.0.1 (loopback)"), ("::ffff:10.1.2.3", "embeds 10.1.2.3 (private)"),
    ("::ffff:169.254.169.254", "embeds 169.254.169.254 (link-local)"),
    ("::127.0.0.1", "IPv4-compatible"), ("::8.8.8.8", "IPv4-compatible"),  # deprecated form: never reached
    ("2002:7f00:1::", "embeds 127.0.0.1 (loopback)"), ("2002:a00:1::", "embeds 10.0.0.1 (private)"),
    ("64:ff9b::7f00:1", "embeds 127.0.0.1 (loopback)"), ("64:ff9b::a9fe:a9fe", "embeds 169.254.169.254 (link-local)"),
    ("64:ff9b:1::a00:1", "embeds 10.0.0.1 (private)"),
    # Teredo: server 65.54.227.120, client 192.0.2.45 (obfuscated in the last 32 bits)
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "embeds 192.0.2.45 (private)"),
    ("2001:db8::1", "private"),  # documentation
]
PUBLIC = ["8.8.8.8", "93.184.215.14", "1.1.1.1", "2606:4700::1111", "2a00:1450:4001::200e",
          "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"]


@pytest.mark.parametrize(("address", "reason"), INWARD)
def test_every_inward_form_is_refused_with_its_reason(address: str, reason: str) -> None:
    assert inward_reason(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_may_be_reached(address: str) -> None:
    assert inward_reason(ipaddress.ip_address(address)) is None


def test_the_allow_list_parses_networks_addresses_and_names() -> None:
    policy = EgressPolicy.parse(" 10.8.0.0/16, 127.0.0.1 ,[::1], Hooks.Internal., fd00::/8,,")
    assert [str(n) for n in policy.networks] == ["10.8.0.0/16", "127.0.0.1/32", "::1/128", "fd00::/8"]
    assert policy.hosts == frozenset({"hooks.internal"})
    assert EgressPolicy.parse("") == EgressPolicy()
    for bad in ("10.0.0.0/33", "http://x", "a b", "300.1.1.1", "-", "under_score"):
        with pytest.raises(ValueError, match="neither a network"):
            EgressPolicy.parse(bad)


def test_the_allow_list_allows_what_it_names_and_nothing_else() -> None:
    policy = EgressPolicy.parse("10.8.0.0/16,127.0.0.1,hooks.internal")
    ip = ipaddress.ip_address
    assert refusal(policy, "x", ip("10.8.3.4")) is None
    assert refusal(policy, "x", ip("10.9.0.1")) == "private"
    assert refusal(policy, "x", ip("127.0.0.1")) is None
    assert refusal(policy, "x", ip("::ffff:127.0.0.1")) is None  # the same address, IPv4-mapped
    assert refusal(policy, "x", ip("127.0.0.2")) == "loopback"
    assert refusal(policy, "x", ip("::1")) == "loopback"
    assert refusal(policy, "HOOKS.internal.", ip("169.254.169.254")) is None  # a named host: whatever it resolves to
    assert refusal(policy, "other.internal", ip("169.254.169.254")) == "link-local"
    assert refusal(EgressPolicy(), "x", ip("8.8.8.8")) is None


def test_numeric_host_forms_resolve_through_the_system_resolver_without_a_lookup() -> None:
    # libc's own parsing (inet_aton): what the connection would use, so what the check must see.
    for host in ("127.1", "0x7f000001", "2130706433", "017700000001", "0177.0.0.1"):
        assert system_resolver(host, 80) == ["127.0.0.1"], host
    egress = Egress()
    for url in ("http://127.1/", "http://0x7f000001:8080/x", "http://2130706433/"):
        with pytest.raises(EgressRefused) as refused:
            egress.target(url)
        assert refused.value.code == NOT_ALLOWED and "127.0.0.1 (loopback)" in str(refused.value)


def test_every_address_of_a_name_is_checked() -> None:
    resolver = TableResolver({"mixed.example": [PUBLIC_ADDRESS, "10.0.0.7"], "public.example": [PUBLIC_ADDRESS,
                                                                                              "2606:4700::1111"]})
    egress = Egress(resolver=resolver)
    with pytest.raises(EgressRefused) as refused:
        egress.target("https://mixed.example/hook")
    assert refused.value.code == NOT_ALLOWED and "10.0.0.7 (private)" in str(refused.value)
    target = egress.target("https://public.example:8443/hook")
    assert (target.host, target.port) == ("public.example", 8443)
    assert [str(a) for a in target.addresses] == [PUBLIC_ADDRESS, "2606:4700::1111"]
    # An address literal is taken as it is: no lookup.
    assert [str(a) for a in egress.target("http://[2606:4700::1111]/").addresses] == ["2606:4700::1111"]
    assert resolver.asked == ["mixed.example", "public.example"]


def test_a_name_that_does_not_resolve_or_resolves_too_slowly_is_refused_in_bounded_time() -> None:
    with pytest.raises(EgressRefused) as refused:
        Egress(resolver=TableResolver()).target("http://nowhere.invalid/")
    assert refused.value.code == UNRESOLVABLE

    release = threading.Event()

    def hanging(_host: str, _port: int) -> list[str]:  # a DNS server that never answers
        release.wait(30)
        return [PUBLIC_ADDRESS]

    t0 = time.monotonic()
    try:
        with pytest.raises(EgressRefused) as refused:
            Egress(resolver=hanging, timeout_s=0.3).target("http://slow.example/")
    finally:
        release.set()
    assert refused.value.code == UNRESOLVABLE and "took over 0.3 s" in str(refused.value)
    assert time.monotonic() - t0 < 5


# Issue 52: `\` or a percent-escape before the host. Each of these reaches example.com through this service's
# parsers, and another host through a parser that reads `\` as `/` (WHATWG) or decodes before it splits.
AMBIGUOUS = [
    ("https://evil.example\\@example.com/hook", "a backslash ('\\')"),
    ("https://evil.example\\.example.com/hook", "a backslash ('\\')"),
    ("https://example.com\\/hook", "a backslash ('\\')"),
    ("https://evil.example%2f@example.com/hook", "a percent-escape ('%')"),
    ("https://evil.example%2F@example.com/hook", "a percent-escape ('%')"),
    ("https://evil.example%5c@example.com/hook", "a percent-escape ('%')"),
    ("https://user:p%40ss@example.com/hook", "a percent-escape ('%')"),
    ("https://ex%61mple.com/hook", "a percent-escape ('%')"),
    ("https://[fe80::1%25eth0]/hook", "a percent-escape ('%')"),
]
PLAIN = ["https://example.com/hook", "https://user:pw@example.com:8443/a%2fb\\c?x=%2f#%40",
         "http://[2606:4700::1111]/", "https://xn--bcher-kva.example/"]


@pytest.mark.parametrize(("url", "why"), AMBIGUOUS)
def test_an_authority_with_a_backslash_or_a_percent_escape_is_refused(url: str, why: str) -> None:
    assert authority_refusal(url) == why
    # Also at each delivery, for a row stored before registration refused it; nothing is resolved.
    resolver = TableResolver()
    with pytest.raises(EgressRefused) as refused:
        Egress(resolver=resolver).target(url)
    assert refused.value.code == NOT_ALLOWED and resolver.asked == []


@pytest.mark.parametrize("url", PLAIN)
def test_escapes_after_the_authority_and_plain_users_are_not_refused(url: str) -> None:
    assert authority_refusal(url) is None
