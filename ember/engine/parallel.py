"""Tensor parallelism over torch.distributed: a rank's group, the collectives its shard runs, and
the step plans that rank 0 broadcasts. Imported only when tensor_parallel_size is above 1.

Every rank holds a shard of the model (models.sharding) and runs the same forward over the same
tokens. The scheduler runs on rank 0 only: before each forward, rank 0 broadcasts the step's
items (engine.runner.StepItem) as msgpack bytes; the other ranks (`follow`) run them and take
part in the collectives the shard's layers ask for (models.layers): the embedding's lookups and
every row-parallel layer's partial products summed over ranks, and the LM head's vocabulary
slices gathered on rank 0, which alone samples. Each rank's KV cache holds its KV heads only;
block ids are rank 0's, so every rank sizes its pool to the smallest any of them can hold.

Two process groups. The default one, with the rendezvous' long timeout (engine.ranks), carries
what happens once while the ranks load at their own pace: the settings and the KV pool's size.
The steps' group carries everything a step does, with STEP_TIMEOUT: a rank that is gone (its
connections close) or stuck that long makes the others' collective fail, and they raise
GroupDown, which says so. An idle rank 0 keeps the others' wait for the next plan well inside
STEP_TIMEOUT by an empty plan every HEARTBEAT_S, from a thread of its own (an idle
ember.llm.LLM has no loop that could send them).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from ember.config import ModelConfig
from ember.engine.runner import StepItem, step_items
from ember.errors import EngineUnavailable
from ember.models.layers import use_tensor_parallel
from ember.models.sharding import Cut, ShardPlan, comm_bytes_per_token, cut_for, local_config, plan_shards

logger = logging.getLogger("ember.engine")

STEP_TIMEOUT = timedelta(seconds=60)  # the longest a rank waits in a step's collective
HEARTBEAT_S = 0.5  # an idle rank 0's empty plans: 120 of them within STEP_TIMEOUT


class StepPlan(msgspec.Struct, array_like=True):
    items: list[StepItem]  # empty: a heartbeat
    stop: bool = False  # the group is closing: followers return


_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_encoder = msgspec.msgpack.Encoder()


class GroupDown(EngineUnavailable):
    """A collective of the tensor-parallel group failed: a rank exited or stopped answering."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the tensor-parallel group is down: a rank exited or did not answer within "
                         f"{STEP_TIMEOUT.total_seconds():.0f} s ({_first_sentence(cause)})",
                         code="tensor_parallel_group_down")


def _first_sentence(exc: BaseException) -> str:
    """A torch.distributed error's first sentence, without the source location gloo puts first."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0]


@contextlib.contextmanager
def _collective():
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's errors (its DistBackendError is one)
        raise GroupDown(exc) from None


class TensorGroup:
    """This process's rank in the tensor-parallel group; `steps`: the steps' process group."""

    def __init__(self, rank: int, world: int, local_rank: int, steps) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.steps = steps
        self.model_config: ModelConfig | None = None
        self.plans: list[ShardPlan] = []
        self.on_close = None  # rank 0: reaps the ranks it started (engine.ranks)
        # rank 0: one step or one heartbeat at a time; the first failure, kept for every later call
        self._lock = threading.Lock()
        self._last_plan = time.monotonic()
        self._down: GroupDown | None = None
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def plan(self) -> ShardPlan:
        return self.plans[self.rank]

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """A CUDA rank uses the GPU of its local rank."""
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    # ---- the model's shard ----------------------------------------------------------------------

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank builds its model from (and remember every rank's shard)."""
        self.model_config = config
        self.plans = plan_shards(config, self.world)
        if self.is_leader:
            volume = comm_bytes_per_token(config, 4)
            logger.info("tensor parallel over %d ranks: query heads %s, KV heads %s; per token and step the ranks "
                        "sum %d bytes over the group, and rank 0 gathers %d bytes of logits per sampled token",
                        self.world, [p.num_heads for p in self.plans], [p.num_kv_heads for p in self.plans],
                        volume["sums"], volume["logits_gather"])
        return local_config(config, self.plan)

    def cut(self, name: str) -> Cut | None:
        return cut_for(name, self.model_config, self.plan)

    def attach(self, model: torch.nn.Module) -> None:
        """A loaded shard's layers where the ranks meet run their collectives through this group."""
        use_tensor_parallel(model, self)

    # ---- the shard's collectives (models.sharding.TensorParallel) --------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        with _collective():
            dist.all_reduce(tensor, group=self.steps)

    def sum_over_ranks(self, sums: torch.Tensor, add_partial: Callable[[], None], in_order: bool) -> None:
        if not in_order:
            add_partial()
            self.all_reduce(sums)
            return
        # rank after rank, as one rank sums K's blocks in order; the last rank's sums are the total
        last = self.world - 1
        if self.rank > 0:
            with _collective():
                dist.recv(sums, src=self.rank - 1, group=self.steps)
        add_partial()
        with _collective():
            if self.rank < last:
                dist.send(sums, dst=self.rank + 1, group=self.steps)
            dist.broadcast(sums, src=last, group=self.steps)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """(N, this rank's vocabulary rows) float32 -> (N, vocab) on rank 0, None elsewhere."""
        widths = [p.vocab_stop - p.vocab_start for p in self.plans]
        padded = torch.nn.functional.pad(local, (0, max(widths) - local.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths] if self.is_leader else None
        with _collective():
            dist.gather(padded, parts, dst=0, group=self.steps)
        if not self.is_leader:
            return None
        return torch.cat([part[:, :width] for part, width in zip(parts, widths)], dim=1)

    # ---- once, while loading (the default group) -------------------------------------------------

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the settings)."""
        return _broadcast_bytes(data, None)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    # ---- the steps' plans ---------------------------------------------------------------------------

    def wrap_runner(self, runner):
        """Rank 0's runner sends each step's items to the other ranks, then runs them (and from now
        on an idle rank 0 sends heartbeats); the others' run what they receive (`follow`)."""
        if not self.is_leader:
            return runner
        self._heartbeat = threading.Thread(target=self._beat_while_idle, name="ember-tp-heartbeat", daemon=True)
        self._heartbeat.start()
        return LeaderRunner(runner, self)

    @contextlib.contextmanager
    def step(self):
        """Rank 0: hold the group for a step (no heartbeat in between); GroupDown once it failed."""
        with self._lock:
            if self._down is not None:
                raise self._down
            try:
                yield
            except GroupDown as exc:
                self._down = exc
                raise

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0, within `step`."""
        with _collective():
            _broadcast_bytes(_encoder.encode(plan), self.steps)
        self._last_plan = time.monotonic()

    def receive_plan(self) -> StepPlan:
        with _collective():
            return _plan_decoder.decode(_broadcast_bytes(None, self.steps))

    def heartbeat(self) -> None:
        """Rank 0, idle: an empty plan unless one went out within HEARTBEAT_S; GroupDown once a
        rank is gone, so an idle engine notices before the next request."""
        with self.step():
            self._beat()

    def _beat(self) -> None:
        if time.monotonic() - self._last_plan >= HEARTBEAT_S:
            self.send_plan(StepPlan([]))

    def _beat_while_idle(self) -> None:
        while not self._closing.wait(HEARTBEAT_S / 2):
            if not self._lock.acquire(blocking=False):
                continue  # a step runs: its plan is the followers' news
            try:
                if self._down is not None:
                    return
                self._beat()
            except GroupDown as exc:
                self._down = exc
                logger.error("%s", exc)
                return
            finally:
                self._lock.release()

    def close(self) -> None:
        """Rank 0: tell the followers to stop; every rank: leave the group."""
        if self.is_leader:
            self._closing.set()
            if self._heartbeat is not None:
                self._heartbeat.join()
            try:
                with self.step():
                    self.send_plan(StepPlan([], stop=True))
            except GroupDown as exc:  # a follower already gone
                logger.warning("%s", exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.on_close is not None:
            self.on_close()


def _broadcast_bytes(data: bytes | None, group) -> bytes:
    """Rank 0's `data` on every rank of `group` (its length first, then the bytes, as CPU tensors)."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return data if data is not None else buffer.numpy().tobytes()


class LeaderRunner:
    """Rank 0's ModelRunner: each step's items go to the other ranks, then run here too. Only
    `execute` is offered: another way into the model would run it on rank 0 alone, and the
    followers would wait in the collectives for a forward they never got."""

    def __init__(self, runner, group: TensorGroup) -> None:
        self.runner = runner
        self.group = group
        self.model, self.cache, self.device = runner.model, runner.cache, runner.device

    def execute(self, scheduled):
        items = step_items(scheduled, self.runner.block_size)
        with self.group.step():
            self.group.send_plan(StepPlan(items))
            return self.runner.execute(scheduled, items)


def follow(runner, group: TensorGroup) -> None:
    """A follower's loop: run every step rank 0 sends, until it says stop. A collective that
    fails (a rank exited or stopped answering) raises GroupDown, and this rank's process ends."""
    while True:
        plan = group.receive_plan()
        if plan.stop:
            return
        if plan.items:  # else a heartbeat
            runner.forward(plan.items)
