"""A server child (engine worker, tensor-parallel rank) never outlives its spawner: a child whose
spawner died before the child could ask the kernel to follow it exits instead of waiting forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from ember.engine.parent_death import PARENT_PID, child_environment

# A child that asks to die with its parent, then says it lived on (and waits a little, as a worker
# waits for its settings).
CHILD = textwrap.dedent("""
    import time
    from ember.engine.parent_death import die_with_parent
    die_with_parent()
    print("alive", flush=True)
    time.sleep(0.5)
""")


def run_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)


def test_a_child_of_a_live_spawner_lives():
    env = child_environment()
    assert env[PARENT_PID] == str(os.getpid())
    child = run_child(env)
    assert child.returncode == 0 and child.stdout == "alive\n"


def test_a_child_whose_spawner_is_gone_exits_at_once():
    """Its parent (this process) is not the spawner it was told of: as when the spawner died and
    another process adopted the child before it ran die_with_parent."""
    env = {**os.environ, PARENT_PID: str(os.getpid() + 1_000_000)}  # no such process
    child = run_child(env)
    assert child.returncode == 1 and child.stdout == ""


def test_a_child_started_by_hand_is_left_alone():
    env = {key: value for key, value in os.environ.items() if key != PARENT_PID}
    assert run_child(env).stdout == "alive\n"


def test_a_given_environment_is_kept_and_named():
    env = child_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", PARENT_PID: str(os.getpid())}


# A child (as a worker) that starts a grandchild (as a tensor-parallel rank), both following their
# parents; the child prints both pids, then both wait to be killed.
CHAIN = textwrap.dedent("""
    import subprocess, sys, time
    from ember.engine.parent_death import child_environment, die_with_parent
    die_with_parent()
    rank = subprocess.Popen([sys.executable, "-c", "from ember.engine.parent_death import die_with_parent; "
                             "die_with_parent(); print('rank', flush=True); import time; time.sleep(600)"],
                            env=child_environment(), stdout=subprocess.PIPE, text=True)
    rank.stdout.readline()
    print(rank.pid, flush=True)
    time.sleep(600)
""")
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    from ember.engine.parent_death import child_environment
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_environment())
    time.sleep(600)
""")


def test_a_killed_spawner_takes_its_child_and_grandchild_with_it():
    """As `ember serve` killed with SIGKILL takes its worker and the worker's ranks."""
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, CHAIN], stdout=subprocess.PIPE, text=True)
    try:
        rank_pid = int(spawner.stdout.readline())
        descendants = psutil.Process(spawner.pid).children(recursive=True)
        assert rank_pid in [p.pid for p in descendants] and len(descendants) == 2
        spawner.send_signal(signal.SIGKILL)
        spawner.wait()
        deadline = time.monotonic() + 2  # the bound the server promises; the kernel acts at once
        while _running(descendants) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _running(descendants) == []
    finally:
        if spawner.poll() is None:
            spawner.kill()
            spawner.wait()


def _running(processes: list[psutil.Process]) -> list[int]:
    running = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return running
