"""The Host and Origin rules (ember.server.origin_guard), without a server."""

from __future__ import annotations

import pytest

from ember.server.origin_guard import HostRules, origin_allowed


@pytest.mark.parametrize("host, allowed", [
    ("localhost", True), ("localhost:8000", True), ("LOCALHOST:8000", True), ("127.0.0.1:8000", True),
    ("127.9.9.9", True), ("[::1]:8000", True), ("[::1]", True), (None, True),
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False),
    ("127.0.0.1.nip.io", False), ("10.0.0.5:8000", False), ("[::1", False), ("localhost:80x", False), ("", False),
])
def test_a_loopback_server_answers_only_to_loopback_names(host, allowed):
    assert HostRules("127.0.0.1", []).allows(host) is allowed


def test_names_given_and_the_listening_address_pass():
    rules = HostRules("10.0.0.5", ["ember.internal", ".lan.example"])
    for host in ("10.0.0.5:8000", "ember.internal", "EMBER.INTERNAL:8000", "a.lan.example", "b.c.lan.example:1"):
        assert rules.allows(host), host
    for host in ("10.0.0.6", "lan.example.evil", "xember.internal", "evil.example"):
        assert not rules.allows(host), host


def test_a_server_on_every_address_answers_to_any_ip_but_not_to_names():
    rules = HostRules("0.0.0.0", [])
    assert rules.allows("192.168.1.20:8000") and rules.allows("[fe80::1]:8000")
    assert not rules.allows("my-box.example:8000")
    assert HostRules("::", []).allows("10.1.2.3")


def test_a_star_turns_the_host_check_off():
    assert HostRules("127.0.0.1", ["*"]).allows("anything.example")


def test_origins():
    assert origin_allowed("http://a.example", "127.0.0.1:8000", ["http://a.example"])
    assert origin_allowed("http://evil.example", "127.0.0.1:8000", ["*"])
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", [])  # the server's own page
    assert origin_allowed("http://LOCALHOST:8000", "localhost:8000", [])
    for origin, host in (("http://evil.example", "127.0.0.1:8000"), ("http://127.0.0.1:9000", "127.0.0.1:8000"),
                         ("null", "127.0.0.1:8000"), ("http://127.0.0.1:8000", None), ("file://", "x"),
                         ("chrome-extension://abc", "abc")):
        assert not origin_allowed(origin, host, ["http://a.example"]), (origin, host)
