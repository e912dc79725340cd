"""The plain-text summary printed at the end of a run."""

from __future__ import annotations

from ember.bench.limits import Bounds, decode_share
from ember.bench.result import BenchResult, LevelResult
from ember.bench.stats import Distribution


def format_report(result: BenchResult) -> str:
    config = result.config
    loop = "open loop (Poisson)" if config.request_rates is not None else "closed loop"
    workload = f"multiturn, {config.turns} turns" if config.workload == "multiturn" else f"single, {loop}"
    calibration = result.calibration
    sections = [
        "\n".join([
            f"ember bench: {result.target} ({config.endpoint}), model {result.model}",
            f"workload: {workload}; input {config.input_len} tokens, output {config.output_len} tokens"
            f"{', ignore_eos' if config.ignore_eos else ''}, temperature {config.temperature:g}, seed {config.seed}",
            f"prompts: {calibration.tokens_per_word:.3f} tokens per word, "
            f"{calibration.overhead_tokens:.0f} tokens of endpoint overhead (calibrated on the target)",
        ]),
        _throughput_table(result.levels),
        _latency_table(result.levels),
    ]
    if config.workload == "multiturn":
        sections.append(_turn_table(result.levels))
    if result.bounds is not None:
        sections.append(_bounds_section(result.bounds, result.levels, prefill=config.workload == "single"))
    notes = _notes(result.levels)
    if calibration.overhead_tokens >= config.input_len.low:
        notes.insert(0, f"the endpoint adds about {calibration.overhead_tokens:.0f} tokens to every prompt (its chat "
                        f"template): prompts cannot be as short as {config.input_len.low} tokens")
    if notes:
        sections.append("\n".join(notes))
    return "\n\n".join(sections) + "\n"


def _throughput_table(levels: list[LevelResult]) -> str:
    headers = ["level", "sent", "ok", "errors", "wall s", "req/s", "out tok/s", "prompt tok/req",
               "out tok/req", "out tok/s/req p50"]
    rows = []
    for level in levels:
        s = level.summary
        with_usage = s.num_ok - s.num_missing_usage
        rows.append([level.level.label, str(s.num_sent), str(s.num_ok), str(sum(s.errors.values())),
                     f"{s.wall_s:.2f}", f"{s.requests_per_s:.2f}", f"{s.output_tokens_per_s:.1f}",
                     _per(s.prompt_tokens, with_usage), _per(s.output_tokens, with_usage),
                     _value(s.request_output_tokens_per_s, "p50", 1.0, 1)])
    return _table(headers, rows)


def _latency_table(levels: list[LevelResult]) -> str:
    headers = ["latency (ms)", "p50", "p90", "p99", "mean"]
    rows = []
    for level in levels:
        rows.append([level.level.label, "", "", "", ""])
        s = level.summary
        for name, dist in (("TTFT", s.ttft), ("ITL", s.itl), ("TPOT", s.tpot), ("E2E", s.e2e)):
            rows.append([f"  {name}", *(_value(dist, stat, 1000.0, 1) for stat in ("p50", "p90", "p99", "mean"))])
    return _table(headers, rows)


def _turn_table(levels: list[LevelResult]) -> str:
    headers = ["TTFT by turn", "turn", "ok", "prompt tok", "cached tok", "TTFT p50 ms", "TTFT p90 ms", "TTFT mean ms"]
    rows = []
    for level in levels:
        for turn in level.summary.by_turn or []:
            rows.append([level.level.label, str(turn.turn), str(turn.count), _number(turn.prompt_tokens_mean),
                         _number(turn.cached_tokens_mean), _value(turn.ttft, "p50", 1000.0, 1),
                         _value(turn.ttft, "p90", 1000.0, 1), _value(turn.ttft, "mean", 1000.0, 1)])
    return _table(headers, rows)


def _bounds_section(bounds: Bounds, levels: list[LevelResult], prefill: bool) -> str:
    """Each level's speeds as fractions of what the machine allows: one stream's decode (1 / TPOT)
    against the read bound, many streams' output and a prompt's prefill (its tokens over TTFT)
    against the int8 peak."""
    headers = ["against the machine's limits", "tok/s", "bound tok/s", "share"]
    rows = []
    for level in levels:
        s, streams, label = level.summary, level.level.concurrency, level.level.label
        if streams == 1 and s.tpot is not None and s.tpot.p50 > 0:
            rows.append(_share_row(f"{label} decode (1 / TPOT p50)", 1 / s.tpot.p50, bounds.decode_tokens_per_s,
                                   decode_share(bounds, 1, 1 / s.tpot.p50)))
        elif streams != 1:
            rows.append(_share_row(f"{label} output", s.output_tokens_per_s, bounds.compute_tokens_per_s,
                                   decode_share(bounds, streams, s.output_tokens_per_s)))
        with_usage = s.num_ok - s.num_missing_usage
        if prefill and streams == 1 and with_usage and s.ttft is not None and s.ttft.p50 > 0:
            speed = s.prompt_tokens / with_usage / s.ttft.p50
            rows.append(_share_row(f"{label} prefill (prompt / TTFT p50)", speed, bounds.compute_tokens_per_s,
                                   bounds.of_int8(speed)))
    return bounds.describe() + "\n" + _table(headers, rows)


def _share_row(label: str, speed: float, bound: float, share: float) -> list[str]:
    return [label, f"{speed:.1f}", f"{bound:.1f}", f"{share:.0%}"]


def _notes(levels: list[LevelResult]) -> list[str]:
    notes = []
    for level in levels:
        s, label = level.summary, level.level.label
        if s.errors:
            counts = ", ".join(f"{outcome} x{count}" for outcome, count in s.errors.items())
            notes.append(f"{label}: failed requests by status: {counts}")
        if s.num_cancelled:
            why = "Ctrl-C" if level.stopped_by == "interrupt" else "--max-seconds"
            notes.append(f"{label}: stopped by {why}; {s.num_cancelled} requests in flight were cancelled")
        if s.num_missing_usage:
            notes.append(f"{label}: {s.num_missing_usage} streams carried no usage; their tokens are not counted")
    return notes


def _per(total: int, count: int) -> str:
    return f"{total / count:.1f}" if count else "-"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _value(dist: Distribution | None, stat: str, scale: float, digits: int) -> str:
    return "-" if dist is None else f"{getattr(dist, stat) * scale:.{digits}f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """First column left-aligned, the rest right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(cell.rjust(w) for cell, w in zip(cells[1:], widths[1:]))]).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])
