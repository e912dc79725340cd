"""Host and Origin checks: the defence against DNS rebinding and drive-by requests from web pages.

A web page on another site can make a browser send requests to a server on the user's machine;
a rebinding DNS name can even make the page's own origin resolve to 127.0.0.1. Two checks, made
before any other work, refuse both with 403:

- **Host**: the request must name the server by a loopback name or address (`localhost`,
  `127.0.0.1`, `[::1]`), by the address it listens on, by any IP address when it listens on all
  of them (0.0.0.0 or ::), or by a name given with `--allowed-hosts` (`.example.com` also allows
  its subdomains; `*` turns the check off). A rebinding attack names the server by the
  attacker's host name, which none of these match. A request without a Host header (HTTP/1.0
  tools) is not from a browser and passes.
- **Origin**: a request that carries an Origin header (browsers send it on cross-site requests,
  on POSTs and on CORS preflights) must come from an origin listed in `--cors-origins` (`*`:
  any), or from the server itself (the Origin's host and port equal the Host header's), so
  ember's own page works. Clients other than browsers send no Origin and pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from ember.protocols.errors import Forbidden
from ember.server.middleware import error_response

LOOPBACK_NAMES = ("localhost",)
_WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


class HostRules:
    def __init__(self, listen_host: str, allowed_hosts: list[str]) -> None:
        self.off = "*" in allowed_hosts
        self.listen_host = _bare(listen_host)
        self.names = {name.lower() for name in allowed_hosts if not name.startswith(".")}
        self.suffixes = tuple(name.lower() for name in allowed_hosts if name.startswith("."))

    def allows(self, host_header: str | None) -> bool:
        if self.off or host_header is None:
            return True
        host = _host_of(host_header)
        if host is None:
            return False
        if host in LOOPBACK_NAMES or host == self.listen_host or host in self.names or host.endswith(self.suffixes):
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return address.is_loopback or self.listen_host in _WILDCARD_ADDRESSES


def origin_allowed(origin: str, host_header: str | None, cors_origins: list[str]) -> bool:
    if "*" in cors_origins or origin in cors_origins:
        return True
    if host_header is None or origin == "null":
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return parts.netloc.lower() == host_header.strip().lower()


class OriginGuardMiddleware:
    """Inside the request context (so a refusal has its request id and the route's error shape),
    outside CORS and the API key check."""

    def __init__(self, app, listen_host: str, allowed_hosts: list[str], cors_origins: list[str]) -> None:
        self.app = app
        self.hosts = HostRules(listen_host, allowed_hosts)
        self.cors_origins = list(cors_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        error = None
        if not self.hosts.allows(host):
            error = Forbidden(f"This server does not answer to the host name {host!r}; name it by its address, "
                              "localhost, or a name given with --allowed-hosts.", code="host_not_allowed")
        elif "origin" in headers and not origin_allowed(headers["origin"], host, self.cors_origins):
            error = Forbidden(f"Requests from the web origin {headers['origin']!r} are not allowed; the server "
                              "accepts the origins given with --cors-origins and its own.", code="origin_not_allowed")
        if error is not None:
            await error_response(error, scope.get("ember.record"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _bare(host: str) -> str:
    return host.strip().strip("[]").lower()


def _host_of(host_header: str) -> str | None:
    """The host part of a Host header, lower case, without brackets or port; None if malformed."""
    text = host_header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not text[end + 1:].startswith(":")):
            return None
        return text[1:end]
    name, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    return name or None
