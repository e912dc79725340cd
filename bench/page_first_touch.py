"""What making fresh memory resident costs here: huge pages against ordinary ones, one thread
against the engine's.

    python bench/page_first_touch.py [--mib 256] [--rounds 3]

Each round maps new anonymous regions of --mib MiB, one advised onto huge pages as the engine's KV
pool is (ember.engine.host_memory) and one not, and makes each resident with ResidentPages (what
the pool's populate_ahead calls between steps) on one thread and on torch's thread count: four
regions a round, none written before, all kept to the end. It prints milliseconds per MiB. On bare
metal this is the kernel zeroing pages; in a virtual machine whose host has not yet backed the
guest's memory, each page the guest touches for the first time also waits for the host, and the
guest hands out huge pages from memory it has never used long after it recycles freed small
pages, so the figures move with the machine's history.
"""

from __future__ import annotations

import argparse
import mmap
import time

import torch

from ember.engine.host_memory import HUGE_PAGE, ResidentPages, huge_page_bytes


def ordinary_pages(nbytes: int) -> torch.Tensor:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


def ms_per_mib(region: torch.Tensor, threads: int) -> float:
    pages = ResidentPages(region)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        began = time.perf_counter()
        pages.populate(0, region.numel())
        seconds = time.perf_counter() - began
    finally:
        torch.set_num_threads(before)
    if pages.refused:
        raise SystemExit("this kernel refuses MADV_POPULATE_WRITE (Linux 5.14 on)")
    return seconds * 1e3 / (region.numel() / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = args.mib << 20
    if huge_page_bytes(HUGE_PAGE) is None:
        raise SystemExit("huge pages cannot be asked for here")
    threads = torch.get_num_threads()
    kinds = [("huge pages", huge_page_bytes), ("ordinary pages", ordinary_pages)]
    print(f"ms to make a MiB resident, regions of {args.mib} MiB")
    columns = [f"{kind}, {n} thread{'s' * (n > 1)}" for kind, _ in kinds for n in (1, threads)]
    print("| round | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * 4)
    kept = []
    for round_index in range(args.rounds):
        cells = []
        for _, make in kinds:
            for n in (1, threads):
                region = make(nbytes)
                kept.append(region)
                cells.append(f"{ms_per_mib(region, n):.2f}")
        print(f"| {round_index + 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
