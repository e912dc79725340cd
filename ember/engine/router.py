"""Data parallelism: several engine workers behind one front end, each request sent to the worker
most likely to hold its prompt's prefix.

Every worker is a supervised EngineClient of its own (its own process, KV cache and restarts).
Each reports how its set of cached prefix blocks changed with every step's outputs
(messages.CacheChanges), so the router holds a copy of each worker's block hashes. For a new
request it hashes the prompt's full blocks the way the KV manager does (kv_cache.hash_block,
chained, with the request's cache salt) and counts, per worker, how many leading blocks that
worker holds. The longest match wins if it covers more than half the prompt's blocks (less, such
as a shared system prompt, is no reason to crowd one worker); ties go to the worker running
fewer requests, then to the one chosen longest ago. A worker running more than `max_imbalance`
requests over the least loaded one is passed over whatever it holds, so one hot prefix cannot pile
every request on one worker; nor is a worker whose seats (max_num_seqs) are all taken chosen while
another has one free, so the server's admission (max_num_seqs times the workers) runs every
admitted request at once.

A worker that is down (restarting after a fault) gets no new requests while another serves; the
requests it ran follow EngineClient's rules (run again once on it if the client has seen nothing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
from collections import OrderedDict
from typing import AsyncIterator, Callable, Sequence

import msgspec

from ember.constraint_spec import ConstraintSpec
from ember.engine.client import EngineClient
from ember.engine.kv_cache import hash_block
from ember.engine.messages import EngineInfo, MediaSpan, QueryKind, WorkerSettings, media_key
from ember.engine.stats import EngineStats, sum_stats
from ember.errors import EngineUnavailable
from ember.types import GenerationOutput, SamplingParams

logger = logging.getLogger("ember.engine")

MAX_SESSIONS = 4096  # sessions whose worker the router remembers (the least recent go first)
DEFAULT_MAX_IMBALANCE = 4  # requests a worker may run over the least loaded one and still be chosen
# A match counts only when it covers more than this share of the prompt's blocks: below it (a
# system prompt every request shares, say) the prompt is new anywhere, and load decides.
MIN_MATCH_SHARE = 0.5


def replica_launches(settings: WorkerSettings, count: int,
                     environ=os.environ) -> list[tuple[WorkerSettings, dict[str, str] | None]]:
    """Each of `count` replicas' worker settings and process environment (None: this one's). On
    the CPU the cores this process may use are split evenly (unless --threads gives each its
    number); on GPUs each replica sees its own run of the visible devices, one per rank of its
    tensor-parallel group (CUDA_VISIBLE_DEVICES)."""
    engine = settings.engine
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = engine.num_threads or max(1, cores // count)
    per_replica = getattr(engine, "tensor_parallel_size", 1)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(count * per_replica)]
    launches = []
    for index in range(count):
        env = None
        if engine.device != "cpu":
            env = {**environ, "CUDA_VISIBLE_DEVICES": ",".join(devices[index * per_replica:(index + 1) * per_replica])}
        replica = msgspec.structs.replace(settings, engine=dataclasses.replace(engine, num_threads=threads),
                                          report_cache_changes=True)
        launches.append((replica, env))
    return launches


def choose_worker(matched: Sequence[int], running: Sequence[int], last_chosen: Sequence[int],
                  serving: Sequence[bool], max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                  seats: int | None = None, preferred: int | None = None) -> int:
    """The worker for a request: among those serving, with a free seat when any has one (`seats`
    each; None: no limit), and within `max_imbalance` running requests of the least loaded, the
    one whose cache holds the most leading blocks of the prompt (`matched`), then the `preferred`
    one (the worker of the request's session: its earlier turns, whose prefix may not be cached
    yet, ran there), then the one running fewest, then the one chosen longest ago (`last_chosen`:
    the number of the last request each was sent, -1 for none), then the first."""
    candidates = [i for i, up in enumerate(serving) if up]
    if not candidates:
        raise EngineUnavailable("no engine worker is serving")
    if seats is not None:
        candidates = [i for i in candidates if running[i] < seats] or candidates
    least = min(running[i] for i in candidates)
    fair = [i for i in candidates if running[i] - least <= max_imbalance]
    return max(fair, key=lambda i: (matched[i], i == preferred, -running[i], -last_chosen[i], -i))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                        media: Sequence[MediaSpan] = ()) -> list[bytes]:
    """The chained hashes of the prompt's blocks a prefix cache could hold for it: whole blocks,
    short of the last token (KVCacheManager.get_computed_blocks always computes that one)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        stop = start + block_size
        parent = hash_block(parent, token_ids[start:stop], cache_salt, media_key(media, start, stop) if media else None)
        hashes.append(parent)
    return hashes


def leading_matches(hashes: Sequence[bytes], cached: set[bytes]) -> int:
    """How many of the prompt's first blocks a worker holds (a prefix cache reads no further than
    the first miss)."""
    count = 0
    for block_hash in hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


class EngineRouter:
    """engine.contract.Engine over several EngineClients: what the server holds under data parallelism."""

    def __init__(self, clients: list[EngineClient], max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if len(clients) < 2:
            raise ValueError("a router needs at least two engine workers")
        self.clients = clients
        self.max_imbalance = max_imbalance
        self.seats = clients[0].settings.engine.max_num_seqs  # each worker's; every worker runs the same settings
        self.running = [0] * len(clients)  # requests in flight on each worker
        self.routed = [0] * len(clients)  # requests sent to each worker, ever
        self.last_chosen = [-1] * len(clients)  # the number of the last request sent to each
        self.cached_tokens_routed = [0] * len(clients)  # prompt tokens each was chosen for holding
        self._owners: dict[str, int] = {}  # request id -> its worker
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session key -> its worker, least recent first
        self._ids = itertools.count()
        self._numbers = itertools.count()  # requests routed, numbered in order

    # ---- starting and stopping ----------------------------------------------------------------

    def launch(self) -> EngineInfo:
        """Start every worker at once and wait until all are loaded; if one fails, stop the others
        and raise its error."""
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(client.launch) for client in self.clients]
            concurrent.futures.wait(futures)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            for client, future in zip(self.clients, futures):
                if future.exception() is None:
                    client.shutdown()
            raise failed
        return self.info

    def start(self) -> None:
        for client in self.clients:
            client.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            list(pool.map(lambda client: client.shutdown(timeout), self.clients))

    # ---- state --------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo | None:
        """The first loaded worker's (every worker runs the same settings)."""
        return next((client.info for client in self.clients if client.info is not None), None)

    @property
    def status(self) -> str:
        """ok while any worker serves; loading while none does and one is starting; else unavailable."""
        statuses = {client.status for client in self.clients}
        return "ok" if "ok" in statuses else "loading" if "loading" in statuses else "unavailable"

    @property
    def failed(self) -> str | None:
        reasons = [f"worker {i}: {client.failed}" for i, client in enumerate(self.clients) if client.failed]
        return "; ".join(reasons) or None

    @property
    def latest_stats(self) -> EngineStats | None:
        """Every field summed over the workers (gauges and counters alike are totals)."""
        snapshots = [stats for stats in (client.latest_stats for client in self.clients) if stats is not None]
        if not snapshots:
            return None
        return sum_stats(snapshots)

    def health(self) -> dict:
        workers = []
        for index, client in enumerate(self.clients):
            stats = client.latest_stats
            workers.append({"worker": index, "status": client.status, **client.health(),
                            "requests_running": self.running[index],
                            "requests_routed": self.routed[index],
                            "routed_cached_tokens": self.cached_tokens_routed[index],
                            "cached_blocks": len(client.cached_blocks),
                            "stats": dataclasses.asdict(stats) if stats is not None else None})
        return {"worker_pid": None, "worker_restarts": sum(client.worker_restarts for client in self.clients),
                "workers": workers}

    async def wait_ready(self, timeout: float | None) -> bool:
        """True once any worker serves; False when none does within `timeout` or all gave up."""
        if self.status != "loading":
            return self.status == "ok"
        waits = [asyncio.ensure_future(client.wait_ready(timeout)) for client in self.clients]
        try:
            for done in asyncio.as_completed(waits):
                if await done:
                    return True
            return False
        finally:
            for wait in waits:
                wait.cancel()

    # ---- requests -----------------------------------------------------------------------------

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None,
              media: Sequence[MediaSpan] = (), session: str | None = None) -> tuple[int, int]:
        """(the worker for this prompt, how many of its tokens that worker's cache holds); a
        session's worker is remembered for its next request."""
        block_size = self.info.block_size
        hashes = prompt_block_hashes(prompt_token_ids, block_size, cache_salt, media)
        matched = [leading_matches(hashes, client.cached_blocks) for client in self.clients]
        counted = [count if count > MIN_MATCH_SHARE * len(hashes) else 0 for count in matched]
        serving = [client.status == "ok" for client in self.clients]
        index = choose_worker(counted, self.running, self.last_chosen, serving, self.max_imbalance, self.seats,
                              preferred=self.sessions.get(session) if session is not None else None)
        if session is not None:
            self.sessions[session] = index
            self.sessions.move_to_end(session)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return index, matched[index] * block_size

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       constraint: ConstraintSpec | None = None, report_progress: bool = False,
                       may_retry: Callable[[], bool] | None = None, media: Sequence[MediaSpan] = (),
                       session: str | None = None) -> AsyncIterator[GenerationOutput]:
        """EngineClient.generate on the worker `route` picks."""
        if not await self.wait_ready(None):
            raise EngineUnavailable(f"the engine is not running: {self.failed}")
        request_id = request_id or f"req-{next(self._ids)}"
        index, cached_tokens = self.route(prompt_token_ids, cache_salt, media, session)
        self.running[index] += 1
        self.last_chosen[index] = next(self._numbers)
        self.routed[index] += 1
        self.cached_tokens_routed[index] += cached_tokens
        self._owners[request_id] = index
        try:
            async for output in self.clients[index].generate(
                    prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt, constraint=constraint,
                    report_progress=report_progress, may_retry=may_retry, media=media):
                output.dp_rank = index
                yield output
        finally:
            self.running[index] -= 1
            self._owners.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None:
            self.clients[index].abort(request_id)

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Compiled on the least loaded serving worker (the request may then run on another, which
        compiles the grammar again)."""
        serving = [i for i, client in enumerate(self.clients) if client.status == "ok"]
        if not serving:
            raise EngineUnavailable("no engine worker is serving")
        await self.clients[min(serving, key=lambda i: self.running[i])].check_constraint(spec)

    async def query(self, kind: QueryKind, constraint: ConstraintSpec | None = None) -> list:
        """Every serving worker's answer, in worker order."""
        return list(await asyncio.gather(*(client.query(kind, constraint) for client in self.clients
                                           if client.status == "ok")))
