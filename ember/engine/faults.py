"""Fault injection for tests of supervision, off unless asked for.

`ember serve` reads the EMBER_INJECT_FAULT environment variable once, at start, and hands it to
the engine worker it launches first (a restarted worker runs clean, unless `always` is given):

    kill@N     the worker kills itself with SIGKILL as its N-th model step begins
    raise@N    the N-th model step raises, as a device fault would
    hang@N     the N-th model step never ends, as a stuck kernel or a deadlocked collective would
    exit@load  the worker exits while loading
    ...,always every worker, restarted ones included (a fault loop)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV_VAR = "EMBER_INJECT_FAULT"
KINDS = ("kill", "raise", "hang", "exit")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kind: str
    step: int = 0  # 0: while loading
    always: bool = False

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        spec, _, flag = text.partition(",")
        kind, _, where = spec.partition("@")
        if kind not in KINDS or flag not in ("", "always") or not where:
            raise ValueError(f"{ENV_VAR}={text!r}: expected kill@N, raise@N, hang@N or exit@load, optionally ',always'")
        if kind == "exit":
            if where != "load":
                raise ValueError(f"{ENV_VAR}={text!r}: exit happens only @load")
            return cls(kind, 0, bool(flag))
        if not where.isdigit() or int(where) < 1:
            raise ValueError(f"{ENV_VAR}={text!r}: the step must be a positive integer")
        return cls(kind, int(where), bool(flag))

    def at_load(self) -> None:
        if self.kind == "exit":
            os._exit(3)

    def at_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "raise":
            raise InjectedFault(f"injected device fault at step {step}")
        while self.kind == "hang":  # until the front end's watchdog kills the process
            time.sleep(3600)
