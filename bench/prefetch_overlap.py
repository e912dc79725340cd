"""Whether asking for memory ahead lets one core's arithmetic run beside its reads.

    python bench/prefetch_overlap.py [--region-kib 64] [--work-us 0,2,4] [--piece-kib 2] [--rounds 3]

One thread walks a buffer larger than the caches (on huge pages, as the engine's KV pool lies) in
regions of --region-kib KiB (64 KiB: the keys and values one decode item of attention reads, 16
blocks of head dim 64 in bfloat16), each in one run or, with --piece-kib, in pieces scattered at
random (as a sequence's decode blocks lie in the pool). A region costs, by column: `read`, a load
of each of its cache lines; `work, read`, --work-us microseconds of arithmetic that touches no
memory, then the read; `prefetch, work, read`, every line of the next region asked for at once
(`__builtin_prefetch` to L2, as ember/kernels/attention.cpp asks for a split's blocks), the work,
then the read of the region asked for a step before; `work with a prefetch a piece, read`, the
next region's lines asked for one at a time, spread evenly through the work. Microseconds a
region, the whole and the read alone. Where the requests run beside the work, the whole comes
near the larger of the read and the work; where they wait for the lines a core can keep in
flight, to the sum of the two, and only the read alone shrinks.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.cpp_extension import load_inline

from ember.engine.host_memory import huge_page_bytes

SOURCE = r"""
#include <torch/extension.h>
#include <chrono>
#include <cstdint>

// Per region: (whole, read) nanoseconds, averaged. `pieces`: where each piece of `piece` bytes lies in
// the buffer, in walking order, region after region. mode 0: read; 1: work, read; 2: prefetch the next
// region, work, read; 3: the next region's lines asked for one at a time among pieces of the work, read.
std::vector<double> walk(torch::Tensor buffer, torch::Tensor pieces, int64_t piece, int64_t region, int64_t work_steps,
                         int64_t mode) {
  using clock = std::chrono::steady_clock;
  const char* base = static_cast<const char*>(buffer.data_ptr());
  const int64_t* at = pieces.data_ptr<int64_t>();
  const int64_t per_region = region / piece, regions = pieces.numel() / per_region, lines = region / 64;
  uint64_t seen = 0;
  float x = 1.0f;
  const auto work = [&](int64_t steps) {
    for (int64_t s = 0; s < steps; ++s) x = x * 1.0000001f + 0.5f;
  };
  double read_ns = 0;
  const auto began = clock::now();
  for (int64_t r = 0; r < regions; ++r) {
    const bool ahead = mode >= 2 && r + 1 < regions;
    const int64_t* next = at + (r + 1) * per_region;
    if (mode == 3) {
      for (int64_t p = 0; p < per_region; ++p)
        for (int64_t line = 0; line < piece; line += 64) {
          if (ahead) __builtin_prefetch(base + next[p] + line, 0, 2);
          work(work_steps / lines);
        }
    } else {
      if (ahead && mode == 2)
        for (int64_t p = 0; p < per_region; ++p)
          for (int64_t line = 0; line < piece; line += 64) __builtin_prefetch(base + next[p] + line, 0, 2);
      if (mode >= 1) work(work_steps);
    }
    const auto read_began = clock::now();
    for (int64_t p = 0; p < per_region; ++p)
      for (int64_t line = 0; line < piece; line += 64)
        seen ^= *reinterpret_cast<const volatile uint64_t*>(base + at[r * per_region + p] + line);
    read_ns += std::chrono::duration<double, std::nano>(clock::now() - read_began).count();
  }
  const double whole = std::chrono::duration<double, std::nano>(clock::now() - began).count();
  return {whole / regions, read_ns / regions, double(seen & 1) + x};
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--region-kib", type=int, default=64)
    parser.add_argument("--work-us", default="0,2,4", help="arithmetic a region, microseconds (a list)")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--piece-kib", type=int, default=None,
                        help="regions made of pieces of this size scattered over the buffer at random, as a "
                             "sequence's cache blocks lie in the pool (default: each region in one run)")
    parser.add_argument("--rounds", type=int, default=3, help="walks per figure, the fastest counts")
    args = parser.parse_args()
    module = load_inline("ember_prefetch_overlap", SOURCE, functions=["walk"], extra_cflags=["-O2"])
    region = args.region_kib << 10
    buffer = huge_page_bytes(args.buffer_mib << 20)  # as the engine's KV pool lies (ember.engine.host_memory)
    if buffer is None:
        buffer = torch.empty(args.buffer_mib << 20, dtype=torch.uint8)
    buffer.fill_(1)
    piece = region if args.piece_kib is None else args.piece_kib << 10
    count = buffer.numel() // piece
    in_order = args.piece_kib is None
    order = torch.arange(count) if in_order else torch.randperm(count, generator=torch.Generator().manual_seed(0))
    pieces = piece * order

    def figures(steps: int, mode: int) -> tuple[float, float]:
        runs = [module.walk(buffer, pieces, piece, region, steps, mode) for _ in range(args.rounds)]
        return min(run[0] for run in runs) / 1e3, min(run[1] for run in runs) / 1e3

    # the work's speed, from a walk of one region that stays in the caches
    small, calibration = torch.ones(region, dtype=torch.uint8), 1_000_000
    one_region = torch.zeros(1, dtype=torch.int64)
    per_step_ns = min(module.walk(small, one_region, region, region, calibration, 1)[0] for _ in range(3)) / calibration
    layout = "in one run" if in_order else f"in scattered pieces of {args.piece_kib} KiB"
    print(f"one thread, regions of {args.region_kib} KiB {layout} over {args.buffer_mib} MiB; "
          f"us a region (whole / read alone)")
    print("| work a region | read | work, read | prefetch, work, read | work with a prefetch a piece, read |")
    print("| --- | --- | --- | --- | --- |")
    for work_us in (float(w) for w in args.work_us.split(",")):
        steps = int(work_us * 1e3 / per_step_ns)
        cells = [figures(steps, mode) for mode in (0, 1, 2, 3)]
        print(f"| {work_us:g} us | " + " | ".join(f"{whole:.2f} / {read:.2f}" for whole, read in cells) + " |")


if __name__ == "__main__":
    main()
