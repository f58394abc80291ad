"""How big a speculative round should be, and whether to draft at all.

Tree size. :class:`CostModel` fits the wall time of a round's verification as ``a + b *
block_size`` from the rounds it has seen (``a``: round trip, fixed local and server overhead;
``b``: per-node compute at both ends plus bytes over the link) and tracks the drafting time per
round ``d`` beside it; each round keeps the prefix of the best-first draft tree that maximizes
``(1 + expected accepted nodes) / (d + a + b * block_size)``. On a GPU trunk behind a WAN that
means big trees; on a small CPU box, small ones. A learned draft head is told how much a level
of its tree must be expected to add to pay for the level's time at that rate
(:attr:`engine.drafts.learned.HeadDraft.min_gain`).

Under load (several sessions on one batching trunk) a row costs more than this client's own
time. A trunk that reports its load (:class:`engine.protocol.Load`: ``peers`` other steps per
step, ``row_ms`` marginal compute per row, ``fixed_ms`` per batch, ``busy``) lets the cost model
price a round of ``n`` rows in *office seconds* (docs/performance.md, "Speculation under load"):

* ``own(n) = d + a + (b + peers * row_ms) * n`` — this client's round, plus the time each of its
  rows takes from the ``peers`` steps that share its batch or wait behind it;
* ``trunk(n) = fixed_ms + (peers + 1) * row_ms * n`` — on a saturated trunk everybody waits on
  the trunk, so a round's cost is the trunk time it uses (its share of the batch's fixed cost,
  ``fixed_ms / (peers + 1)``) times the ``peers + 1`` sessions that wait for it;
* ``cost(n) = (1 - w) * own(n) + w * trunk(n)``, ``w = busy * peers / (peers + 1)``: the share
  of the trunk's time that goes to others while it is busy.

Trees maximize ``E[committed] / cost(n)`` and :class:`ModeChooser` compares drafted rounds with
one-token steps in the same office seconds, so both serve the office's committed tokens per
second, not this client's alone. Alone on the trunk ``peers`` is 0 and nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.protocol import Load

MIN_SPREAD = 16.0  # variance of recent block sizes (nodes^2) the cost model's slope needs
SIZE_SLACK = 0.06  # the cost model takes the largest tree within 6 % of the best predicted rate
# fewer other steps per step than this (on average) and the trunk counts as ours alone: a lone
# client's own session-switch (its closing session's last reply) must not change its choices
ALONE_PEERS = 0.5
# a round slower than STALL_FACTOR times its predicted time plus STALL_MARGIN seconds is a stall
# (a network or machine hiccup), not what rounds cost: it is not learned from (CostModel.stalled)
STALL_FACTOR = 4.0
STALL_MARGIN = 0.25


class CostModel:
    """Verification time ≈ a + b · block_size, by exponentially weighted least squares, plus the
    drafting time per round (a moving average), which every choice pays alike."""

    def __init__(self, decay: float = 0.97, prior_a: float = 0.05, prior_b: float = 0.002) -> None:
        self.decay = decay
        self.prior_a = prior_a
        self.prior_b = prior_b
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._fitted_b: float | None = None  # the last slope fitted over varied sizes
        self.draft_s = 0.0  # seconds of drafting per round (moving average)
        self.tokens = 0.0  # tokens committed per round (moving average)
        # the trunk's load (module docstring): seconds each row sent takes from the others
        # (peers * row_ms), the weight of the saturated-trunk view, and that view's a and b
        self.shared_s = 0.0
        self.weight = 0.0
        self.trunk_a = self.trunk_b = 0.0
        self._skipped = False  # the last round was taken for a stall

    def stalled(self, rows: int, seconds: float) -> bool:
        """Whether a round of ``rows`` rows whose verification took ``seconds`` is a one-off
        stall that nothing should learn from: slower than ``STALL_FACTOR`` times the predicted
        time plus ``STALL_MARGIN``, the round before it not being one.

        One round stalled by the network or the machine (a second of Wi-Fi trouble) early in a
        session fitted a per-node price that made every later look at drafting lose on paper,
        and drafting stayed off until the session ended. A slow round right after one taken for
        a stall is learned from: two in a row say the link or the machine really changed (a
        satellite link's first rounds, a trunk newly under load), and the fit must follow."""
        slow = seconds > STALL_FACTOR * self.predict(rows) + STALL_MARGIN
        self._skipped = slow and not self._skipped
        return self._skipped

    def set_load(self, load: Load | None) -> None:
        """Price rounds in office seconds by the trunk's reported load (None: our own time)."""
        if load is None or load.peers < ALONE_PEERS:
            self.shared_s = self.weight = self.trunk_a = self.trunk_b = 0.0
            return
        self.shared_s = shared_row_s(load)
        self.weight = load.busy * load.peers / (load.peers + 1.0)
        self.trunk_a = load.fixed_ms / 1000.0
        self.trunk_b = (load.peers + 1.0) * load.row_ms / 1000.0

    def office_line(self, own_a: float, own_b: float) -> tuple[float, float]:
        """(a, b) of a round's office cost ``a + b * rows``, from its own ``own_a + own_b *
        rows`` (the module docstring's ``cost(n)``)."""
        w = self.weight
        return (
            (1.0 - w) * own_a + w * self.trunk_a,
            (1.0 - w) * (own_b + self.shared_s) + w * self.trunk_b,
        )

    def office_seconds(self, seconds: float, rows: int) -> float:
        """A finished round's office cost: its wall time ``seconds`` and ``rows`` rows sent."""
        a, b = self.office_line(seconds, 0.0)
        return a + b * rows

    def observe_round(self, draft_seconds: float, committed: int) -> None:
        """Drafting time and committed tokens of one round (for the rate a head must beat)."""
        if self.tokens == 0.0:
            self.draft_s, self.tokens = draft_seconds, float(committed)
            return
        self.draft_s = 0.9 * self.draft_s + 0.1 * draft_seconds
        self.tokens = 0.9 * self.tokens + 0.1 * committed

    def rate(self, block_size: int) -> float:
        """Tokens per second of a round that sends ``block_size`` nodes and commits the recent
        average."""
        a, b = self.coefficients()
        oa, ob = self.office_line(self.draft_s + a, b)
        return max(self.tokens, 1.0) / (oa + ob * block_size)

    def seed_slope(self, rows: int, seconds: float) -> None:
        """A prompt of ``rows`` rows read in ``seconds``: until a slope is fitted, the per-node
        cost is taken as at least that time per row.

        The default prior (2 ms per node) suits a trunk behind a WAN, where the round trip
        dominates; a laptop verifying a 1.5B model's trees by itself pays 20+ ms per node, and
        trees sized by that prior cost seconds for a token or two. Reading the prompt measures
        what a row costs here (the round trip and first-call costs included: an upper bound,
        which only makes the first trees small; the exploration rounds then fit the slope).
        """
        if self._fitted_b is None and rows > 0 and seconds > 0:
            self.prior_b = max(self.prior_b, seconds / rows)

    def observe(self, block_size: int, seconds: float) -> None:
        d = self.decay
        n = float(block_size)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds
        if self.spread() > MIN_SPREAD:
            self._fitted_b = self.coefficients()[1]

    @property
    def slope_known(self) -> bool:
        """Whether a slope was ever fitted (over sizes varied enough), not just assumed."""
        return self._fitted_b is not None

    def spread(self) -> float:
        """Variance of the block sizes seen (the slope is only known when this is large)."""
        if self._w <= 0:
            return 0.0
        mn = self._n / self._w
        return self._nn / self._w - mn * mn

    def coefficients(self) -> tuple[float, float]:
        if self._w <= 0:
            return self.prior_a, self.prior_b
        mn = self._n / self._w
        mt = self._t / self._w
        var = self._nn / self._w - mn * mn
        # the slope needs enough spread in block sizes; until then the prior, and once a slope
        # was fitted, that slope (a run of one-token steps says nothing new about big trees,
        # and falling back to the prior then would send the next look a tree sized for it)
        if var > MIN_SPREAD:
            b = (self._nt / self._w - mn * mt) / var
        else:
            b = self.prior_b if self._fitted_b is None else self._fitted_b
        b = max(b, 1e-5)
        a = max(mt - b * mn, 1e-4)
        return a, b

    def predict(self, block_size: int) -> float:
        a, b = self.coefficients()
        return a + b * block_size

    def choose(self, path_probs: Sequence[float]) -> int:
        """How many draft nodes (a prefix of the best-first order) maximize tokens per second of
        office time: ``E[committed] / cost(block_size)`` (module docstring; alone on the trunk
        ``cost(n) = d + a + b * n``).

        Near its best the predicted rate is flat over a wide range of sizes; there the largest
        size within ``SIZE_SLACK`` of the best rate is taken: it needs fewer round trips for the
        same speed, so the network's jitter and a shared trunk's queue cost less. When the trunk
        reports other sessions (``shared_s`` > 0) the best size itself is taken."""
        rates = self._rates(path_probs)
        # (on a shared trunk the rows past the best cost the others more than a round trip
        # saves: no slack there)
        floor = max(rates) * (1.0 - (SIZE_SLACK if self.shared_s == 0 else 0.0))
        return max(n for n, r in enumerate(rates) if r >= floor)

    def _rates(self, path_probs: Sequence[float]) -> list[float]:
        """Predicted tokens per office second of a round sending the first 0, 1, 2 ... nodes."""
        a, b = self.coefficients()
        a, b = self.office_line(a + self.draft_s, b)  # our own time alone: unchanged
        rates = [1.0 / (a + b)]
        expected = 1.0
        for i, p in enumerate(path_probs):
            expected += p
            rates.append(expected / (a + b * (i + 2)))
        return rates

    def prefix_rate(self, path_probs: Sequence[float], n: int) -> float:
        """Predicted tokens per office second of a round sending the first ``n`` nodes."""
        return self._rates(path_probs[:n])[n]


def shared_row_s(load: Load) -> float:
    """Seconds of the other sessions' time one more row in a step costs: ``peers * row_ms``.

    Each of the ``peers`` steps sharing a batch with ours, or queued behind it, finishes
    ``row_ms`` later per row we add."""
    return load.peers * load.row_ms / 1000.0


class ModeChooser:
    """Whether drafting pays at all: speculative rounds against plain one-token steps.

    The cost model sizes trees from the drafter's own estimates; when drafting does not pay
    (no learned head for the model, text the context sources cannot predict, a fast trunk next
    to a slow client) even its best tree loses to one-token steps, which skip the drafting and
    verify one row. Both kinds of round commit exactly the tokens sequential decoding would, so
    the choice changes speed only. It is made on measured rates — tokens committed per second
    of whole rounds (drafting, verification and learning) — and the kind not chosen is tried
    again after 4, 8, 16 ... ``MAX_PROBE`` rounds (back to 4 when the choice flips), so a
    change in the text or the link is noticed at a small, shrinking cost. Under load the
    seconds observed are office seconds (:meth:`CostModel.office_seconds`): the wall time and
    the rows sent, priced by what they cost the trunk's other sessions."""

    WARM = 3  # speculative rounds before the first one-token steps are timed
    SEQ_PROBE = 2  # one-token steps per look at their rate
    MAX_PROBE = 64  # longest wait between looks at the kind not chosen
    DECAY = 0.8  # weight of the past in each kind's moving averages

    def __init__(self) -> None:
        self.spec_s = self.spec_tokens = 0.0  # per speculative round (moving averages)
        self.seq_s = 0.0  # per one-token step (moving average)
        self.spec_rounds = self.seq_rounds = 0
        self.sequential = False  # the kind chosen now
        self._interval = 4  # rounds between looks at the other kind
        self._since = 0  # rounds since the last look
        self._probing = 0  # rounds left of the current look
        self._decided = False  # the first choice is made once both kinds were timed

    def spec_rate(self) -> float:
        return self.spec_tokens / self.spec_s if self.spec_s > 0 else 0.0

    def seq_rate(self) -> float:
        return 1.0 / self.seq_s if self.seq_s > 0 else 0.0

    def next_is_sequential(self) -> bool:
        """The kind of the next round: True for a one-token step."""
        if self.spec_rounds < self.WARM:
            return False
        if self.seq_rounds < self.SEQ_PROBE:
            return True
        if self._probing > 0:
            return not self.sequential
        return self.sequential

    def observe(self, sequential: bool, seconds: float, committed: int) -> None:
        """One finished round: its kind, wall time and committed tokens."""
        d = self.DECAY
        if sequential:
            self.seq_s = seconds if not self.seq_rounds else d * self.seq_s + (1 - d) * seconds
            self.seq_rounds += 1
        else:
            if not self.spec_rounds:
                self.spec_s, self.spec_tokens = seconds, float(committed)
            else:
                self.spec_s = d * self.spec_s + (1 - d) * seconds
                self.spec_tokens = d * self.spec_tokens + (1 - d) * committed
            self.spec_rounds += 1
        if self.spec_rounds < self.WARM or self.seq_rounds < self.SEQ_PROBE:
            return  # still timing both kinds for the first choice
        if not self._decided:
            self._decided = True
            self._decide()
        elif self._probing > 0:
            self._probing -= 1
            if self._probing == 0:
                self._decide()
        else:
            self._since += 1
            if self._since >= self._interval:  # look at the other kind again
                self._since = 0
                self._probing = 1 if self.sequential else self.SEQ_PROBE

    def _decide(self) -> None:
        best = self.seq_rate() > self.spec_rate()
        if best != self.sequential:
            self.sequential, self._interval = best, 4
        else:
            self._interval = min(2 * self._interval, self._max_probe())

    def _max_probe(self) -> int:
        """The longest wait between looks: ``MAX_PROBE`` rounds, four times that while the kind
        not chosen commits less than half as fast (a look costs most then, and is least likely
        to change the choice)."""
        lo, hi = sorted((self.seq_rate(), self.spec_rate()))
        return self.MAX_PROBE * (4 if lo < 0.5 * hi else 1)


def explore_size(chosen: int, available: int, max_nodes: int) -> int:
    """The block size of an exploration round: the same size every round says nothing about the
    cost per node, and a slope fitted over a narrow range of sizes is mostly noise (a too-steep
    one keeps trees small, and small trees never show it wrong). Every fourth round, while the
    recent sizes vary too little, sends a clearly different size: twice the choice plus 8 (as
    far as the proposal goes), or half of it when that would not fit."""
    bigger = min(2 * chosen + 8, available, max_nodes)
    if bigger - chosen >= 8:
        return bigger
    return chosen // 2


def proposal_size(recent: Sequence[int], max_nodes: int) -> int:
    """How many nodes to draft before the cost model trims: twice the biggest recent choice plus
    some slack (drafting costs CPU time per node; the cost model rarely wants much more than it
    just chose, and can double its choice every round), at most ``max_nodes``."""
    if not recent:
        return max_nodes
    return max(1, min(max_nodes, 8 + 2 * max(recent)))
