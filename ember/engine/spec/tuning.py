"""How many tokens to draft next: fixed, or the length that makes the most tokens per second of
the whole step, from what verifying a row costs and how often drafts on the same evidence hold.

A decode step of `rows` rows takes about a + b * rows seconds, and drafting k tokens about
f + g * k (a draft model's own steps; next to nothing for n-gram lookup), both fitted from the
engine's own steps (StepCost). If the i-th drafted token is kept with chance h_i once the ones
before it are (DraftLength learns each position apart), k drafts gain
E(k) = h_1 + h_1 h_2 + ... + h_1 ... h_k tokens. Among B decoding rows the step makes
(B + E(k)) / (a + b * (B + k) + f + g * k) tokens per second; the tuned length is the k that
maximizes it, 0 when no k beats plain decoding. One stream on a CPU, where a row is a tenth of a
step, drafts long when its drafts hold; a full batch, where rows cost nearly their share, drafts
only what it is nearly sure of. Over that, DraftingGate checks the model against the clock: per
batch size, a step drafts only while drafted steps have been making more tokens per second.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.config import MAX_TUNED_DRAFT_TOKENS

_PRIOR_ACCEPT = 0.5  # the first guess that a first drafted token is kept, worth _PRIOR_WEIGHT rounds...
_PRIOR_WEIGHT = 2.0
_MEMORY = 0.9  # ...and older rounds fade by this factor at each new one
_PAUSE_ROUNDS = 8  # evidence that should not draft waits this many asks to try again (doubling, at most 64)
_PROBE_TOKENS = 2  # the draft that tests whether drafting pays
_ROW_SHARE_PRIOR = 0.05  # before any varied step is seen: one row's cost over a one-row step's
_DRAFT_STEP_SHARE_PRIOR = 1.0  # until draft lengths vary: a round's fixed cost equals one drafted token's
_COST_MEMORY = 0.995  # observations' weight in the cost fits fades by this factor each step


class LinearFit:
    """y ~ a + b * x by least squares, weighted toward recent observations. While x has hardly
    varied, the slope comes from a prior: b = share * a."""

    __slots__ = ("share", "_w", "_x", "_y", "_xx", "_xy")

    def __init__(self, share: float) -> None:
        self.share = share
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def seen(self) -> bool:
        return self._w > 0

    def observe(self, x: float, y: float) -> None:
        m = _COST_MEMORY
        self._w = self._w * m + 1.0
        self._x = self._x * m + x
        self._y = self._y * m + y
        self._xx = self._xx * m + x * x
        self._xy = self._xy * m + x * y

    def coefficients(self) -> tuple[float, float]:
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance > 0.25:  # x varied: fit the slope
            b = (self._xy / self._w - mean_x * mean_y) / variance
            a = mean_y - b * mean_x
            if a >= 0 and b > 0:
                return a, b
        a = max(mean_y, 0.0) / (1 + self.share * mean_x)
        return a, self.share * a


class StepCost:
    """What a round costs: the forward, seconds ~ a + b * rows over decode steps (no prefill),
    and drafting, seconds ~ f + g * draft length (the longest in the round: a draft model runs
    that many steps of its own)."""

    __slots__ = ("forward", "drafting")

    def __init__(self) -> None:
        self.forward = LinearFit(_ROW_SHARE_PRIOR)
        self.drafting = LinearFit(_DRAFT_STEP_SHARE_PRIOR)

    def observe(self, rows: int, seconds: float) -> None:
        self.forward.observe(rows, seconds)

    def observe_drafting(self, longest: int, seconds: float) -> None:
        if longest:
            self.drafting.observe(longest, seconds)

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, f, g) in seconds; (1, share, 0, 0) in units of a step when nothing is known yet."""
        a, b = self.forward.coefficients() if self.forward.seen else (1.0, _ROW_SHARE_PRIOR)
        f, g = self.drafting.coefficients() if self.drafting.seen else (0.0, 0.0)
        return a, b, f, g


def best_draft_length(holds: Sequence[float], batch_rows: int, cost: tuple[float, float, float, float],
                      most: int) -> int:
    """The k in 0..most that maximizes the step's tokens per second (module docstring); holds[i]:
    the chance the (i+1)-th drafted token is kept once the ones before it are."""
    a, b, f, g = cost
    best, best_rate = 0, batch_rows / (a + b * batch_rows)
    gained, power = 0.0, 1.0
    for k in range(1, most + 1):
        power *= holds[k - 1]
        gained += power
        rate = (batch_rows + gained) / (a + b * batch_rows + f + (b + g) * k)
        if rate > best_rate * 1.01:  # a gain under 1% is not worth a round's risk
            best, best_rate = k, rate
    return best


_GATE_FIRST_STEPS = 3  # steps of each kind seen before the gate chooses
_GATE_LOOK_EVERY = 16  # steps between looks at the way the gate does not favour...
_GATE_LOOK_MOST = 256  # ...doubling, up to this, each time a look leaves the verdict as it was
_GATE_MEMORY = 0.9  # the favoured way's rate fades by this per step; a look at the other way counts half


class _BatchSizeVerdict:
    __slots__ = ("rates", "steps", "since_look", "look_every", "looked")

    def __init__(self) -> None:
        self.rates = [0.0, 0.0]  # tokens per second of steps without drafts, with drafts
        self.steps = [0, 0]
        self.since_look = 0
        self.look_every = _GATE_LOOK_EVERY
        self.looked: bool | None = None  # the verdict when the last look was taken, until it is judged

    @property
    def drafts(self) -> bool:
        return self.rates[1] >= self.rates[0]


class DraftingGate:
    """Whether a step drafts at all, learnt per batch size (1, 2-3, 4-7, ... decoding rows): the
    tokens per second of decode steps that verified drafts against those that did not, the
    drafting's own time included. What the cost model misses (a draft model's overheads, a
    verify path slower than decode) shows here. Now and then a step goes the other way, so a
    change in the text or the load is noticed; a look that changes nothing makes the next one
    wait twice as long, so a way that keeps losing (a draft model beside a full batch, whose
    drafted steps cost several plain ones) costs next to nothing."""

    __slots__ = ("_sizes",)

    def __init__(self) -> None:
        self._sizes: dict[int, _BatchSizeVerdict] = {}

    def _size(self, batch_rows: int) -> _BatchSizeVerdict:
        size = self._sizes.get(batch_rows.bit_length())
        if size is None:
            size = self._sizes[batch_rows.bit_length()] = _BatchSizeVerdict()
        return size

    def allows(self, batch_rows: int) -> bool:
        size = self._size(batch_rows)
        if size.steps[1] < _GATE_FIRST_STEPS:
            return True
        if size.steps[0] < _GATE_FIRST_STEPS:
            return False
        verdict = size.drafts
        if size.looked is not None:  # the last look has been observed: judge it
            size.look_every = min(size.look_every * 2, _GATE_LOOK_MOST) if verdict == size.looked else _GATE_LOOK_EVERY
            size.looked = None
        size.since_look += 1
        if size.since_look >= size.look_every:
            size.since_look = 0
            size.looked = verdict
            return not verdict
        return verdict

    def observe(self, batch_rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        size = self._size(batch_rows)
        kind = int(drafted)
        rate = tokens / max(seconds, 1e-9)
        if not size.steps[kind]:
            size.rates[kind] = rate
        else:
            weight = 1 - _GATE_MEMORY if drafted == size.drafts else 0.5
            size.rates[kind] += weight * (rate - size.rates[kind])
        size.steps[kind] += 1


class DraftLength:
    """Per evidence (a request, or an n-gram match length): fixed, or tuned (best_draft_length)
    from how often each position of a draft has held: of the rounds that reached their (i+1)-th
    drafted token, the share that kept it. Rounds are seldom geometric (a copy either runs on for
    many tokens or breaks at its first), so the first position is learnt apart from the later
    ones; a position not yet reached takes the one before it as its prior. When drafting does not
    pay by that estimate, it first probes (a short draft, so that the first position is learnt
    from this text rather than the prior), then pauses for a while, then probes again."""

    __slots__ = ("fixed", "_reached", "_kept", "_pause", "_paused_for", "_probe")

    def __init__(self, fixed: int | None) -> None:
        self.fixed = fixed
        # rounds that reached and that kept each position, fading by _MEMORY at each new one; the
        # first position starts from the prior, as _PRIOR_WEIGHT rounds
        self._reached = [_PRIOR_WEIGHT] + [0.0] * (MAX_TUNED_DRAFT_TOKENS - 1)
        self._kept = [_PRIOR_ACCEPT * _PRIOR_WEIGHT] + [0.0] * (MAX_TUNED_DRAFT_TOKENS - 1)
        self._pause = 0  # steps left without drafting
        self._paused_for = _PAUSE_ROUNDS
        self._probe = True

    def holds(self) -> list[float]:
        """Each position's chance to be kept once the ones before it are."""
        holds = []
        prior = 1.0
        for reached, kept in zip(self._reached, self._kept):
            prior = (kept + prior) / (reached + 1) if holds else kept / reached
            holds.append(prior)
        return holds

    def next(self, batch_rows: int = 1, cost: tuple[float, float, float, float] = (1.0, _ROW_SHARE_PRIOR, 0.0, 0.0),
             most: int = MAX_TUNED_DRAFT_TOKENS) -> int:
        """Tokens to draft this step (0: none, at most `most`) in a step of `batch_rows` decoding rows."""
        if self.fixed is not None:
            return self.fixed
        if self._pause:
            self._pause -= 1
            self._probe = self._pause == 0
            return 0
        length = best_draft_length(self.holds(), batch_rows, cost, most)
        if length:
            return length
        if self._probe:
            self._probe = False
            return min(_PROBE_TOKENS, most)
        self._pause = self._paused_for
        self._paused_for = min(self._paused_for * 2, 64)
        return 0

    def record(self, proposed: int, accepted: int) -> None:
        """A verified round: `accepted` of its `proposed` drafts kept (positions up to the first
        miss were reached)."""
        self.learn(0, accepted, missed=accepted < proposed)
        if proposed and accepted == proposed:
            self.held_whole()

    def learn(self, first: int, kept: int, missed: bool) -> None:
        """Part of a draft's outcome: its positions first .. first + kept - 1 held, and if `missed`
        the one after them did not. A draft may be learnt in parts as its tokens come (Lookups);
        its first part (first 0) ages every position's evidence, reached or not, once a draft."""
        if first == 0:
            for i in range(MAX_TUNED_DRAFT_TOKENS):
                self._reached[i] *= _MEMORY
                self._kept[i] *= _MEMORY
        for i in range(first, min(first + kept, MAX_TUNED_DRAFT_TOKENS)):
            self._reached[i] += 1
            self._kept[i] += 1
        if missed and first + kept < MAX_TUNED_DRAFT_TOKENS:
            self._reached[first + kept] += 1

    def held_whole(self) -> None:
        """A draft held to its end: worth probing again at once if the estimate still says no."""
        self._paused_for = _PAUSE_ROUNDS
        self._probe = True
