"""Tensor parallelism over torch.distributed: a rank's group, the collectives its model runs, and
the step plan that rank 0 broadcasts. Imported only when tensor_parallel_size is above 1.

Every rank holds a shard of the model (models.sharding) and runs the same forward over the same
tokens. The scheduler runs on rank 0 only: before each forward, rank 0 broadcasts the step's
items (engine.runner.StepItem) as msgpack bytes; the other ranks (`follow`) run them and take
part in the collectives the shard's layers ask for (models.layers): the embedding's lookups and
every row-parallel layer's partial products summed over ranks, and the LM head's vocabulary
slices gathered on rank 0, which alone samples. Each rank's KV cache holds its KV heads only;
block ids are rank 0's, so every rank sizes its pool to the smallest any of them can hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist

from ember.config import ModelConfig
from ember.engine.runner import StepItem, step_items
from ember.models.layers import use_tensor_parallel
from ember.models.sharding import Cut, ShardPlan, comm_bytes_per_token, cut_for, local_config, plan_shards

logger = logging.getLogger("ember.engine")


class StepPlan(msgspec.Struct, array_like=True):
    items: list[StepItem]
    stop: bool = False  # the group is closing: followers return


_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_encoder = msgspec.msgpack.Encoder()


class GroupDown(Exception):
    """A follower's wait for the next plan failed: rank 0 is gone."""


class TensorGroup:
    """This process's rank in the tensor-parallel group (the default torch.distributed group)."""

    def __init__(self, rank: int, world: int, local_rank: int) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.model_config: ModelConfig | None = None
        self.plans: list[ShardPlan] = []
        self.on_close = None  # rank 0: reaps the ranks it started (engine.ranks)

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

    # ---- collectives (the shard's: models.sharding.TensorParallel) --------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def sum_over_ranks(self, sums: torch.Tensor, add_partial: Callable[[], None], in_order: bool) -> None:
        if not in_order:
            add_partial()
            self.all_reduce(sums)
            return
        # rank after rank, as one rank sums K's blocks in order; the last rank's sums are the total
        last = self.world - 1
        if self.rank > 0:
            dist.recv(sums, src=self.rank - 1)
        add_partial()
        if self.rank < last:
            dist.send(sums, dst=self.rank + 1)
        dist.broadcast(sums, src=last)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """(N, this rank's vocabulary rows) float32 -> (N, vocab) on rank 0, None elsewhere."""
        widths = [p.vocab_stop - p.vocab_start for p in self.plans]
        padded = torch.nn.functional.pad(local, (0, max(widths) - local.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths] if self.is_leader else None
        dist.gather(padded, parts, dst=0)
        if not self.is_leader:
            return None
        return torch.cat([part[:, :width] for part, width in zip(parts, widths)], dim=1)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (its length first, then the bytes, as CPU tensors)."""
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0)
        if data is not None:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0)
        return data if data is not None else buffer.numpy().tobytes()

    def send_plan(self, plan: StepPlan) -> None:
        self.broadcast_bytes(_encoder.encode(plan))

    def heartbeat(self) -> None:
        """Rank 0, idle: an empty plan, so a rank that died is noticed (the broadcast fails) before
        the next request, and no follower waits in a broadcast past the group's timeout."""
        self.send_plan(StepPlan([]))

    def receive_plan(self) -> StepPlan:
        return _plan_decoder.decode(self.broadcast_bytes(None))

    def wrap_runner(self, runner):
        """Rank 0's runner broadcasts each plan before it runs it; the others' run what they receive."""
        return LeaderRunner(runner, self) if self.is_leader else runner

    def close(self) -> None:
        """Rank 0: tell the followers to stop; every rank: leave the group."""
        if self.is_leader:
            try:
                self.send_plan(StepPlan([], stop=True))
            except RuntimeError as exc:  # a follower already gone
                logger.warning("tensor-parallel group: %s", exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.on_close is not None:
            self.on_close()


class LeaderRunner:
    """Rank 0's ModelRunner: each step's plan goes to the other ranks, then runs here too. Only
    `execute` is offered: another way into the model would run it on rank 0 alone, and the
    followers would wait in the collectives for a forward they never got."""

    def __init__(self, runner, group: TensorGroup) -> None:
        self.runner = runner
        self.group = group
        self.model, self.cache, self.device = runner.model, runner.cache, runner.device

    def execute(self, scheduled):
        items = step_items(scheduled, self.runner.block_size)
        self.group.send_plan(StepPlan(items))
        return self.runner.execute(scheduled, items)


def follow(runner, group: TensorGroup) -> None:
    """A follower's loop: run every plan rank 0 broadcasts, until it says stop. A collective
    that fails (a rank died) raises (GroupDown while waiting for a plan), and this rank's process ends."""
    while True:
        try:
            plan = group.receive_plan()
        except RuntimeError as exc:
            raise GroupDown(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        if plan.stop:
            return
        if plan.items:  # else a heartbeat
            runner.forward(plan.items)
