"""Starting a tensor-parallel group: its processes and their rendezvous (torch.distributed's TCP store).

- Rank 0 is the engine worker (or the process of an ember.llm.LLM). `start_leader` starts the
  other ranks of its own launch as `python -m ember.engine.ranks RANK WORLD HOST:PORT LOCAL_RANK`,
  joins the group at a free localhost port (or --dist-init-addr with several nodes), and sends
  every rank the WorkerSettings, so all of them load the same model with the same engine config.
- A launch on another node (`ember serve --node-rank K`) runs `run_node`: it starts that node's
  ranks, serves no HTTP, and exits when one of them does (the group is down).
- Any rank that dies takes the group down: rank 0 exits when one of its own children does, and
  a step's collective with a rank that is gone, or that has not answered within
  engine.parallel.STEP_TIMEOUT, fails on the others with GroupDown. The engine worker's
  supervisor (engine.client) then starts rank 0 again, which starts a fresh group.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.config import EngineConfig
from ember.engine import messages
from ember.engine.parallel import STEP_TIMEOUT, TensorGroup
from ember.engine.parent_death import child_environment

logger = logging.getLogger("ember.engine")

# How long a rank waits at the rendezvous (rank 0 for a node still starting, too) and in the
# collectives of loading (the settings, the KV pool's size), which wait for the slowest rank's
# load; a step's collectives have STEP_TIMEOUT.
_RENDEZVOUS_TIMEOUT = timedelta(days=7)
_WATCH_S = 0.2


def backend() -> str:
    """gloo for CPU tensors; NCCL for CUDA ones where CUDA is present."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def ranks_per_launch(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def join(rank: int, world: int, address: str, local_rank: int) -> TensorGroup:
    """Join the group at HOST:PORT (rank 0 hosts the store there); returns once all ranks have."""
    dist.init_process_group(backend(), init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=_RENDEZVOUS_TIMEOUT)
    return TensorGroup(rank, world, local_rank, dist.new_group(timeout=STEP_TIMEOUT))


def start_leader(settings: messages.WorkerSettings) -> TensorGroup:
    """Rank 0: start this launch's other ranks, join the group, hand every rank the settings."""
    config = settings.engine
    world = config.tensor_parallel_size
    address = config.dist_init_addr or f"127.0.0.1:{_free_port()}"
    children = [spawn_rank(rank, world, address, local_rank=rank) for rank in range(1, ranks_per_launch(config))]
    watcher = _Watcher(children)
    logger.info("tensor parallel: waiting for %d ranks at %s", world, address)
    group = join(0, world, address, local_rank=0)
    threads = torch.get_num_threads()

    def on_close() -> None:
        # Rank 0 runs in the caller's process: once its group is gone, the process has its cores
        # back (an engine built after it probes its row plans with the threads it will run on).
        watcher.close()
        torch.set_num_threads(threads)

    group.on_close = on_close
    group.broadcast_bytes(messages.encode(settings))
    share_cores(config)
    return group


def share_cores(config: EngineConfig) -> None:
    """The ranks of one launch split its CPU cores, unless the threads are set."""
    if config.num_threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_launch(config)))


def spawn_rank(rank: int, world: int, address: str, local_rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ember.engine.ranks", str(rank), str(world), address,
                             str(local_rank)], stdin=subprocess.DEVNULL, env=child_environment())


def run_node(config: EngineConfig, node_rank: int, first_local_rank: int = 0) -> int:
    """A launch that serves no HTTP: start ranks node_rank * n ... of the group (n ranks per
    launch), wait until one exits, stop the others; its exit status."""
    per_launch = ranks_per_launch(config)
    ranks = range(node_rank * per_launch, (node_rank + 1) * per_launch)
    children = [spawn_rank(rank, config.tensor_parallel_size, config.dist_init_addr, first_local_rank + i)
                for i, rank in enumerate(ranks)]
    logger.info("ranks %s of %d joining the group at %s (no HTTP on this launch)", list(ranks),
                config.tensor_parallel_size, config.dist_init_addr)
    try:
        while all(child.poll() is None for child in children):
            time.sleep(_WATCH_S)
    except KeyboardInterrupt:
        pass
    code = next((child.returncode for child in children if child.returncode is not None), 0)
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        child.wait()
    logger.info("the tensor-parallel group is down (exit status %s)", code)
    return code


class _Watcher:
    """Rank 0's watch over the ranks it started: one that exits takes rank 0 down with it, unless
    the group is closing."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        self.children = children
        self.closing = threading.Event()
        if children:
            threading.Thread(target=self._watch, name="ember-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.closing.wait(_WATCH_S):
            for child in self.children:
                if child.poll() is not None and not self.closing.is_set():
                    logger.error("tensor-parallel rank (pid %d) exited with status %s; the group is down",
                                 child.pid, child.returncode)
                    os._exit(1)

    def close(self, timeout: float = 10.0) -> None:
        self.closing.set()
        for child in self.children:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(argv: list[str]) -> int:
    """A follower rank: join, receive the settings, load this rank's shard, follow rank 0's plans."""
    from dataclasses import replace
    from pathlib import Path

    from ember.config import SpeculativeConfig
    from ember.engine.core import EngineCore
    from ember.engine.parallel import GroupDown, follow
    from ember.engine.parent_death import die_with_parent
    from ember.errors import EmberError
    from ember.loaders import load_model_source

    rank, world, address, local_rank = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    die_with_parent()
    group = join(rank, world, address, local_rank)
    settings = messages.settings_decoder.decode(group.broadcast_bytes(None))
    logging.basicConfig(level=settings.log_level, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s",
                        stream=sys.stderr)
    try:
        source = load_model_source(settings.model, Path(settings.cache_dir) if settings.cache_dir else None,
                                   revision=settings.revision,
                                   ollama_models=Path(settings.ollama_models) if settings.ollama_models else None,
                                   mmproj=settings.engine.mmproj)
        share_cores(settings.engine)
        # drafting happens on rank 0 alone: a follower only runs the verify steps it is sent
        core = EngineCore.from_source(source, replace(settings.engine, speculative=SpeculativeConfig()), group=group)
        follow(core.runner, group)
    except GroupDown as exc:
        logger.warning("rank %d stops: %s", rank, exc)
        return 1
    except Exception as exc:  # rank 0 learns of it from the collective that fails next
        logger.error("rank %d stopped: %s", rank, exc, exc_info=not isinstance(exc, EmberError))
        return 1
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
