"""The machine's own limits and speed figures as fractions of them. The figures are measured by
bench.machine_probe (which imports torch; this module does not, so `ember bench` over HTTP never
loads it).

Three figures, each the best of a few calls on the thread count the engine uses:

- read bandwidth: a matrix-vector product of ember's 8-bit block kernel over a weight far larger
  than the last-level cache (1 GiB by default), which is how a decode step reads its weights; the
  weight's bytes over the call's time. Without ember's kernels, a torch sum over a float32 buffer
  of the same size.
- int8 peak: the same kernel on a compute-bound shape (512 rows times a 4096 x 4096 weight),
  2 x rows x out x in operations over the call's time.
- bfloat16 peak: the engine's bfloat16 linear format (oneDNN prepacked where the processor has
  it, else F.linear) on the same shape.

The bounds they give: one stream decodes at most read bandwidth / weight bytes per token tokens a
second (at a long context, read bandwidth / (weight bytes + the keys and values a step reads:
cache_bytes_read)); many streams and prefill do at most int8 peak / (2 x weights) tokens a second (every weight
is one multiply and one add per token; a tied table counts once, as the LM head).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class MachineLimits:
    threads: int
    read_gb_per_s: float
    read_method: str  # what read the buffer: ember's int8 kernel, or a torch sum without it
    int8_gops: float  # ember's int8 block kernel, 2 operations per multiply-add
    bf16_gflops: float  # the engine's bfloat16 linear format
    seconds: float  # how long the probe took

    def describe(self) -> str:
        return (f"machine limits ({self.threads} threads): read {self.read_gb_per_s:.1f} GB/s ({self.read_method}), "
                f"int8 {self.int8_gops:.0f} GOP/s, bfloat16 {self.bf16_gflops:.0f} GFLOP/s")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Bounds:
    """A loaded model's speed limits on this machine."""

    limits: MachineLimits
    weight_bytes: int  # what one decode step reads (engine.weight_footprint)
    num_weights: int

    @property
    def decode_tokens_per_s(self) -> float:
        """One stream's ceiling: every step reads every weight once."""
        return self.limits.read_gb_per_s * 1e9 / self.weight_bytes

    @property
    def compute_tokens_per_s(self) -> float:
        """Many streams' and prefill's ceiling: every token multiplies and adds every weight once."""
        return self.limits.int8_gops * 1e9 / (2 * self.num_weights)

    def of_read(self, tokens_per_s: float, cache_bytes: int = 0) -> float:
        """One stream's speed against the read bound; `cache_bytes`: the keys and values each step
        reads besides the weights (a long context's, which can outweigh them)."""
        return tokens_per_s * (self.weight_bytes + cache_bytes) / (self.limits.read_gb_per_s * 1e9)

    def of_int8(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.compute_tokens_per_s

    def describe(self) -> str:
        return (f"{self.limits.describe()}; weights {self.weight_bytes / 1e9:.3f} GB, "
                f"{self.num_weights / 1e6:.0f} M: one stream at most {self.decode_tokens_per_s:.0f} tok/s, "
                f"many streams and prefill at most {self.compute_tokens_per_s:.0f} tok/s")

    def to_json(self) -> dict:
        return {"limits": self.limits.to_json(), "weight_bytes": self.weight_bytes, "num_weights": self.num_weights,
                "decode_tokens_per_s": self.decode_tokens_per_s, "compute_tokens_per_s": self.compute_tokens_per_s}


def cache_bytes_read(layer_windows: list[int | None], num_layers: int, bytes_per_key: int, context: int) -> int:
    """The keys and values a decode step at `context` tokens reads: every layer's, a sliding
    window's layer its window's (`layer_windows` empty: none has one); `bytes_per_key`: one
    token's key and value in one layer."""
    windows = layer_windows or [None] * num_layers
    return sum(min(context, window or context) for window in windows) * bytes_per_key


def decode_share(bounds: Bounds, streams: int | None, tokens_per_s: float) -> float:
    """Decode speed as a fraction of its bound: one stream's against the read bound, many
    streams' (all of them together; None: an open loop) against the int8 peak."""
    return bounds.of_read(tokens_per_s) if streams == 1 else bounds.of_int8(tokens_per_s)
