"""The one rule for top-level request fields that no reader on the route looked at.

A dialect's parser is its own list of known fields: every name it asks the body for counts as
known, whether or not it was set, so nothing has to be listed twice. A field nobody asked for is
unknown. By default it is accepted: logged once per field name per process, and listed in the
response's `x-ember-ignored-fields` header. A server started with `--strict-fields` refuses it
with 400 `unknown_parameter` naming it. A field ember knows but cannot honour is refused by its
dialect whatever this setting says; this module never sees those. (/v1/systemone refuses unknown
fields at every level itself, as the document it follows does.)

`null` means "not given" everywhere, so an unknown field set to null is neither reported nor
refused.

A few fields ember knows are tolerated without effect for the agents that send them (Responses'
hosted tool declarations): `note_ignored` lists them in the same report, whatever --strict-fields
says, since refusing them would turn those agents away.

The server opens a FieldReport for each request (`watch_fields`, in its middleware, with the
server's setting); the parsers' wrapper (`reads_fields`) fills it in. The report travels in a
context variable because the parsers see only the body and the model, never the HTTP request.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import quote

from ember.errors import InvalidRequest

logger = logging.getLogger("ember.server")

HEADER = "x-ember-ignored-fields"
MAX_HEADER_NAMES = 32  # a body may hold 100,000 keys; the header names the first ones
MAX_LOGGED_NAMES = 256  # distinct names logged per process, so a client cannot flood the log
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-:]{1,128}")

_logged: set[str] = set()
_report: ContextVar["FieldReport | None"] = ContextVar("ember_field_report", default=None)

Parse = TypeVar("Parse", bound=Callable[..., Any])


@dataclass(slots=True)
class FieldReport:
    """One request's unknown fields, and whether they are refused."""

    strict: bool = False
    ignored: list[str] = field(default_factory=list)

    def header_value(self) -> str | None:
        """The header's value: names percent-encoded where they are not plain ASCII (headers carry
        Latin-1 only, and a comma would split a name), the empty name as "", the first
        MAX_HEADER_NAMES of them. (A value may not end in a space: HTTP servers drop the connection.)"""
        if not self.ignored:
            return None
        names = [quote(name, safe="_.-:~[]") or '""' for name in self.ignored[:MAX_HEADER_NAMES]]
        if len(self.ignored) > MAX_HEADER_NAMES:
            names.append(f"...{len(self.ignored) - MAX_HEADER_NAMES} more")
        return ", ".join(names)


@contextlib.contextmanager
def watch_fields(strict: bool) -> Iterator[FieldReport]:
    """The report of the request handled inside this block."""
    report = FieldReport(strict)
    token = _report.set(report)
    try:
        yield report
    finally:
        _report.reset(token)


class _ReadBody(dict):
    """A request's top-level object that remembers every name it was asked for."""

    __slots__ = ("asked",)

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        self.asked: set[Any] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.asked.add(key)
        return super().__contains__(key)


def reads_fields(parse: Parse) -> Parse:
    """Wrap a route's parser (body first): after it has read the body, settle the fields it never
    asked for. A refusal of a field the parser knows comes first, since the parser runs first."""

    @functools.wraps(parse)
    def checked(body: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(body, dict):
            return parse(body, *args, **kwargs)  # the parser refuses what is not an object
        read = _ReadBody(body)
        job = parse(read, *args, **kwargs)
        settle([name for name, value in read.items() if name not in read.asked and value is not None])
        return job

    return checked  # type: ignore[return-value]


def settle(unknown: list[str]) -> None:
    """Refuse the first unknown field (strict), or note them all in the request's report and log."""
    if not unknown:
        return
    report = _report.get()
    if report is not None and report.strict:
        name = unknown[0]
        raise InvalidRequest(f"{_shown(name)} is not a field this route reads, and this server refuses unknown "
                             "fields (--strict-fields)", param=name, code="unknown_parameter")
    for name in unknown:
        if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            logger.info("ignored the unknown request field %s (logged once per field name)", _shown(name))
    if report is not None:
        report.ignored.extend(unknown)


def note_ignored(*names: str) -> None:
    """Known fields this request sent that ember accepts without acting on them, because agent
    clients send them by habit (paths such as `tools[2]`): listed in the header beside the unknown
    ones, never refused."""
    report = _report.get()
    if report is not None:
        report.ignored.extend(names)


def _shown(name: str) -> str:
    """A client's field name as a message or log line shows it: quoted, cut, control characters escaped."""
    if _PLAIN_NAME.fullmatch(name):
        return name
    return repr(name[:64] + ("..." if len(name) > 64 else ""))
