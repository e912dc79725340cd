"""The batch-invariance self-check: on the processor it finds, does a request get the same bits
alone as inside any batch?

A matmul kernel may choose its reduction order from the shape it is handed, and that choice
differs between processors (see models.layers.RowPlan). So the promise is not assumed: after
loading, the engine checks it on its real layers, in two probes.

1. Linear layers. For each distinct weight shape, random rows (with a few large columns, as real
   activations have) go through the layer alone and at many places in batches of many sizes.
   The first candidate row plan, cheapest first, under which every row keeps its bits is kept.
2. The engine. A few short requests of random tokens, greedy and seeded, run alone and then
   together: beside a copy of themselves, beside shorter and longer partners, with a partner
   that finishes early, and with one request joining while another decodes (a step mixing
   prefill and decode). Their log probabilities must be equal bit for bit. A classifier's
   requests score their prompts instead (types.CLASSIFY), and their scores must be.

If the engine probe fails under the plan the first probe chose, the strictest plan (every call
one fixed tile) is tried before the promise is withdrawn. The report says what was found; the
server shows it in /health, at startup and in the request log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ember.models.layers import WHOLE_BATCH, Linear, RowPlan, linear, set_row_plan
from ember.types import CLASSIFY, SamplingParams

logger = logging.getLogger("ember.engine")

# Cheapest first: whole batches, then padding small calls, then tiles, then one fixed tile.
CANDIDATE_PLANS = (RowPlan(1), RowPlan(2), RowPlan(4), RowPlan(8), RowPlan(1, 32), RowPlan(2, 32),
                   RowPlan(4, 32), RowPlan(8, 32), RowPlan(32, 32))
STRICTEST_PLAN = CANDIDATE_PLANS[-1]
# Rows per probed layer: enough that about 2**17 outputs are compared (a different reduction
# order shows in roughly one bfloat16 output in ten thousand), within these bounds.
_PROBE_OUTPUTS, _MIN_PROBE_ROWS, _MAX_PROBE_ROWS = 2**17, 16, 256
_BATCH_SIZES = (2, 3, 4, 5, 7, 8, 13, 31, 32, 33, 48, 64, 100, 256, 1024, 2048)
_SALT = "ember-self-check"


@dataclass(frozen=True, slots=True)
class InvarianceReport:
    """`holds`: the promise was checked and kept on this processor. `reason` says how, or why not."""

    holds: bool
    reason: str
    rows: RowPlan = WHOLE_BATCH
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"holds": self.holds, "reason": self.reason, "row_plan": self.rows.describe(),
                "check_seconds": round(self.seconds, 3)}


def not_promised(reason: str) -> InvarianceReport:
    return InvarianceReport(False, reason)


def check(core) -> InvarianceReport:
    """Choose the row plan of `core`'s model and verify the promise on the whole engine.

    Runs at construction, before any request; leaves the engine idle, its prefix cache empty
    and its counters zero.
    """
    began = time.perf_counter()
    model = core.runner.model
    # a step holds at most its budget of prompt tokens (and its overrun) plus one decode token per
    # running sequence
    max_rows = core.max_num_batched_tokens + core.max_step_overrun + core.config.max_num_seqs
    plan, broken = choose_row_plan(model, max_rows=max_rows,
                                   max_head_rows=core.config.max_num_seqs)
    if plan is None:
        set_row_plan(model, WHOLE_BATCH)
        return InvarianceReport(False, f"no row plan keeps a row's bits in {broken} on this processor",
                                seconds=time.perf_counter() - began)
    set_row_plan(model, plan)
    difference = engine_probe(core)
    if difference is not None and plan != STRICTEST_PLAN:
        logger.warning("batch invariance: %s with linear rows in %s; trying %s", difference, plan.describe(),
                       STRICTEST_PLAN.describe())
        plan = STRICTEST_PLAN
        set_row_plan(model, plan)
        difference = engine_probe(core)
    seconds = time.perf_counter() - began
    if difference is not None:
        set_row_plan(model, WHOLE_BATCH)  # the promise is withdrawn: no reason to pay for it
        return InvarianceReport(False, f"{difference} on this processor", seconds=seconds)
    return InvarianceReport(True, f"checked on this processor: linear rows in {plan.describe()}", plan, seconds)


# ---- probe 1: the linear layers ------------------------------------------------------------

def choose_row_plan(model: torch.nn.Module, max_rows: int, max_head_rows: int,
                    candidates: tuple[RowPlan, ...] = CANDIDATE_PLANS) -> tuple[RowPlan | None, str]:
    """The first plan under which every probed row of every linear shape keeps its lone-row bits;
    (None, the layer that broke the last candidate) if none does."""
    generator = torch.Generator().manual_seed(0)
    probes = [_LayerProbe(name, layer, generator, max_head_rows if name == "lm_head" else max_rows)
              for name, layer in _distinct_linears(model).items()]
    broken = ""
    for plan in candidates:
        broken = next((probe.name for probe in probes if not probe.keeps_bits(plan)), "")
        if not broken:
            return plan, ""
    return None, broken


class _LayerProbe:
    """Rows (with a few columns 30 times larger, as real activations have) through one layer:
    alone, then placed among filler rows in batches of every probed size up to max_rows."""

    def __init__(self, name: str, weights, generator: torch.Generator, max_rows: int) -> None:
        self.name = name
        self.weights = weights
        outputs, width = weights.out_features, weights.in_features
        rows = min(_MAX_PROBE_ROWS, max(_MIN_PROBE_ROWS, _PROBE_OUTPUTS // outputs))
        x = torch.randn(rows, width, generator=generator)
        x[:, :: max(1, width // 5)] *= 30
        self.x = x.to(weights.dtype)
        self.sizes = [s for s in _BATCH_SIZES if s <= max_rows]
        self._alone: dict[int, torch.Tensor] = {}  # min_rows -> every row's lone result

    def run(self, rows: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        return linear(rows, self.weights, plan)

    def keeps_bits(self, plan: RowPlan) -> bool:
        x = self.x
        if plan.min_rows not in self._alone:
            self._alone[plan.min_rows] = torch.cat([self.run(x[i:i + 1], plan) for i in range(x.shape[0])])
        alone = self._alone[plan.min_rows]
        filler = torch.flip(x, dims=(0,))
        for size in self.sizes:
            for offset in range(0, x.shape[0], size):
                probe = x[offset:offset + size]
                count = probe.shape[0]
                where = slice(None)
                if count < size:  # the probe rows spread through a larger batch of filler rows
                    batch = filler.repeat(-(-size // filler.shape[0]), 1)[:size].clone()
                    where = torch.linspace(0, size - 1, count).long()
                    batch[where] = probe
                    probe = batch
                if not torch.equal(self.run(probe, plan)[where], alone[offset:offset + count]):
                    return False
        return True


def _distinct_linears(model: torch.nn.Module) -> dict[str, object]:
    """The weights (models.weights formats) of one layer per distinct format, shape, dtype and
    bias, from the middle of the model, and of the LM head under the name "lm_head"."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    half = len(modules) // 2
    found: dict[tuple, tuple[str, object]] = {}
    for name, module in modules[half:] + modules[:half]:
        w = module.weights
        key = (w.name, w.out_features, w.in_features, w.dtype, w.bias is not None)
        found.setdefault(key, (name, w))
    layers = dict(found.values())  # the LM head, the costliest, comes last
    layers["lm_head"] = model.lm_head.weights
    return layers


# ---- probe 2: the whole engine -------------------------------------------------------------

def engine_probe(core) -> str | None:
    """None if every probe request's tokens and log probabilities are the same alone and in every
    batch; else what differed, in words."""
    vocab = core.model_config.vocab_size
    longest = max(4, min(70, core.max_model_len - 8, core.kv_capacity_tokens // 6 - 8))
    lengths = sorted({max(2, longest // 14), max(3, longest // 3), longest})  # about 5, 23 and 70 tokens
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=3, logprobs=0, ignore_eos=True)
    early = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, ignore_eos=True)
    if core.model_config.num_labels:  # a classifier generates nothing: its probes read their scores
        greedy = seeded = early = SamplingParams(max_tokens=0, pooling=CLASSIFY)
    params = [greedy, seeded, greedy][: len(prompts)]
    runs = _Runs(core)
    try:
        alone = [runs.run([(prompt, p, 0)])[0] for prompt, p in zip(prompts, params)]
        scenarios = {
            "beside shorter and longer partners": [(p, sp, 0) for p, sp in zip(prompts, params)],
            "beside a copy of itself": [(prompts[-1], params[-1], 0), (prompts[-1], params[-1], 0)],
            # the last prompt decodes while the others prefill; the first of them stops early
            "joining or joined mid-decode": [(prompts[-1], params[-1], 0), (prompts[0], early, 1),
                                             (prompts[1], params[1], 2)],
        }
        for name, items in scenarios.items():
            for (prompt, p, _), got in zip(items, runs.run(items)):
                want = alone[prompts.index(prompt)]
                if p is early:
                    want = (want[0][:1], want[1][:1])
                difference = _difference(want, got)
                if difference is not None:
                    return f"a request's {difference} alone and {name}"
        return None
    finally:
        core.kv_manager.reset_prefix_cache()
        core.reset_counters()


class _Runs:
    """Runs lists of (prompt, params, step to join at) to the end on an idle engine."""

    def __init__(self, core) -> None:
        self.core = core
        self.count = 0

    def run(self, items: list[tuple[list[int], SamplingParams, int]]) -> list[tuple[list[int], list[float]]]:
        core = self.core
        self.count += 1
        ids = [f"{_SALT}-{self.count}-{i}" for i in range(len(items))]
        results: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
        step = 0
        while step <= max(join for _, _, join in items) or core.has_unfinished():
            for request_id, (prompt, params, join) in zip(ids, items):
                if join == step:  # a salt of its own: no probe run reuses another's cached blocks
                    core.add_request(request_id, prompt, params, cache_salt=f"{_SALT}-{self.count}")
            for out in core.step():
                tokens, logprobs = results[out.request_id]
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs or ()] + (out.pooled or [])
            step += 1
        return [results[i] for i in ids]


def _difference(want: tuple[list[int], list[float]], got: tuple[list[int], list[float]]) -> str | None:
    if want[0] != got[0]:
        index = next((i for i, (a, b) in enumerate(zip(want[0], got[0])) if a != b), min(len(want[0]), len(got[0])))
        return f"tokens differ from output token {index}"
    for index, (a, b) in enumerate(zip(want[1], got[1])):
        if a != b:
            return f"log probabilities differ at output token {index} (by {abs(a - b):.2g} nats)"
    return None
