"""The agentic micro-batch scheduler: packs completed groups into training rounds while the
rollout of the step is still running.

Contract, per RL step:

    scheduler.begin_step(step, version)
    while generating:  scheduler.add_group(items);  train(scheduler.pop_ready())
    train(scheduler.finish_step());  optimizer step;  sync weights

* A group (G samples of one role answering the same input) is handed over whole, once, when
  its last sample is done. Every item must carry the step's weight version: the update stays
  on-policy (no sample from another policy version is ever mixed in).
* Items are packed into micro-batches that cost at most `token_budget` tokens (and hold at
  most `max_sequences` sequences); a sequence longer than the budget gets a micro-batch of its
  own. A micro-batch costs what the trainer computes for it: `megatron/actor.py`
  `pack_sequences` packs its sequences into one row (attention kept within each sequence), so
  it costs the sum of their lengths (`micro_batch_tokens`), plus fewer than TP tokens the
  trainer pads the row with for sequence parallel (the memory plan rounds up to TP).
* A `Round` is what the data-parallel ranks run together: exactly `dp_size` micro-batches, one
  per rank, all of ONE policy (the ranks of a model run it in lockstep because of the
  expert/tensor-parallel collectives). Only rounds released by `finish_step` may hold empty
  micro-batches (a rank with nothing to do still joins the collectives).
* With `overlap`, a policy's round is formed as soon as its buffer holds `dp_size` micro-batches
  that are ready and of similar cost: a micro-batch is ready when it is full, i.e. no sequence
  of the buffer, and none as short as its own shortest, could join it without breaking the
  budget (or the sequence cap is reached); the round's smallest must cost at least `round_balance` of its
  largest (a round lasts as long as its largest micro-batch). Rounds wait in the order they
  became ready and `pop_ready` hands them out in that order (FIFO). Without overlap (the
  synchronous baseline) nothing is released before `finish_step`.
* `finish_step` releases the waiting rounds, then packs everything left, policy by policy in
  the order given to the constructor, and checks that every item added in the step was
  released exactly once. The trainer accumulates gradients over the rounds and runs one
  optimizer step per policy after it.

Packing: bin-at-a-time best-fit decreasing (open a micro-batch with the longest item left, add
the longest item that still fits in what the budget leaves, repeat until none fits), so long
sequences are topped up with short ones. Micro-batches are sorted by tokens and cut into rounds
of `dp_size`, so a round's micro-batches are of similar size (little lockstep waiting); the
last, partial round of a policy spreads its items over all ranks.

Pure Python: no torch, Megatron or agents.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class SchedulerError(ValueError):
    """A call that breaks the scheduler's contract (wrong version, duplicate, call order)."""


@dataclass(frozen=True, kw_only=True)
class SeqItem:
    """One training sequence as the scheduler sees it: an id, a size, an owner."""

    key: str
    """Unique within the step (e.g. the sample id)."""
    policy: str
    """The policy (model) that trains on it; one of the scheduler's policies."""
    num_tokens: int
    """Prompt + response tokens: what it adds to its micro-batch's cost."""
    version: int
    """Weight version that generated it; must equal the step's version."""
    group_id: str
    """The same-input group it belongs to (groups are added whole)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise SchedulerError(f"item {self.key!r}: num_tokens={self.num_tokens!r} must be a positive integer")


@dataclass(kw_only=True)
class MicroBatch:
    """The sequences one data-parallel rank runs in one forward/backward pass."""

    policy: str
    """The policy all its items belong to."""
    items: list[SeqItem] = field(default_factory=list)
    """Its sequences; empty for a rank that only joins the round's collectives."""

    @property
    def num_tokens(self) -> int:
        """Tokens of its sequences: what it costs against the token budget (`micro_batch_tokens`)."""
        return _cost(self.items)


@dataclass(kw_only=True)
class Round:
    """One micro-batch per data-parallel rank, all of one policy, trained together."""

    policy: str
    """The policy every micro-batch belongs to."""
    micro_batches: list[MicroBatch]
    """Exactly `dp_size` micro-batches; rank r runs `micro_batches[r]`."""
    step: int
    """The RL step it belongs to."""
    index: int
    """Position in the step's release order (0, 1, ...)."""

    @property
    def num_tokens(self) -> int:
        """Tokens of all its micro-batches."""
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def max_tokens(self) -> int:
        """Tokens of the largest micro-batch: what the lockstep round waits for."""
        return max(mb.num_tokens for mb in self.micro_batches)

    @property
    def items(self) -> list[SeqItem]:
        return [item for mb in self.micro_batches for item in mb.items]


@dataclass(kw_only=True)
class SchedulerConfig:
    """How completed groups are packed into micro-batches and when they are released."""

    token_budget: int = 65536
    """Most tokens per micro-batch, the sum of its sequences' lengths (one MarsRL max-length
    output): the trainer packs them into one row (megatron/actor.py pack_sequences), so that is
    what a micro-batch computes. A single longer sequence gets a micro-batch of its own."""
    max_sequences: int | None = None
    """Most sequences per micro-batch; None: only the token budget limits."""
    overlap: bool = True
    """Release rounds while the rollout runs; False releases nothing until finish_step (the
    synchronous baseline)."""
    round_balance: float = 0.9
    """With overlap: a round is released early only when its smallest micro-batch costs at least
    this fraction of its largest (tokens). The ranks run a round in lockstep, so the
    others wait for the largest, and a full micro-batch may cost anywhere from just over half
    the budget (one sequence of 0.6x the budget is full alone) to all of it. Unmatched
    micro-batches wait for later groups or finish_step; 0 releases every ready one at once."""

    def __post_init__(self) -> None:
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ValueError(f"scheduler.token_budget={self.token_budget!r}: must be a positive integer")
        if self.max_sequences is not None and (not isinstance(self.max_sequences, int) or self.max_sequences < 1):
            raise ValueError(f"scheduler.max_sequences={self.max_sequences!r}: must be a positive integer or None")
        if not 0.0 <= self.round_balance <= 1.0:
            raise ValueError(f"scheduler.round_balance={self.round_balance!r}: must be within [0, 1]")

    def max_micro_batch_tokens(self, longest_sequence: int) -> int:
        """The most tokens one micro-batch can cost when no sequence is longer than
        `longest_sequence`: the budget, or one such sequence alone when it exceeds the budget."""
        return max(self.token_budget, micro_batch_tokens([longest_sequence]))


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What the scheduler released in one step."""

    step: int
    """The RL step."""
    version: int
    """The weight version of its items."""
    items: int
    """Sequences released."""
    tokens: int
    """Tokens released (what the trainer computes)."""
    rounds: int
    """Rounds released (by pop_ready and finish_step)."""
    rounds_overlapped: int
    """Rounds released by pop_ready, i.e. trainable while the rollout still ran."""
    micro_batches: int
    """Micro-batch slots (rounds x dp_size), empty ones included."""
    empty_micro_batches: int
    """Slots without items (ranks that only join the collectives)."""
    fill_fraction: float
    """tokens / token capacity of all slots (an oversized micro-batch counts as full)."""
    idle_fraction: float
    """Share of the lockstep rank-time not spent on tokens: ranks waiting for their round's
    largest micro-batch."""


class MicroBatchScheduler:
    """Packs one step's completed groups into rounds for `dp_size` data-parallel ranks."""

    def __init__(self, config: SchedulerConfig, *, dp_size: int, policies: Sequence[str]):
        if not isinstance(dp_size, int) or dp_size < 1:
            raise SchedulerError(f"dp_size={dp_size!r}: must be a positive integer")
        if not policies or len(set(policies)) != len(policies):
            raise SchedulerError(f"policies={list(policies)!r}: give at least one, without repeats")
        self.config, self.dp_size, self.policies = config, dp_size, tuple(policies)
        self._step: int | None = None
        self._version = 0
        self._open = False
        self._reset()

    def _reset(self) -> None:
        self._buffers: dict[str, list[SeqItem]] = {p: [] for p in self.policies}
        self._ready: deque[Round] = deque()
        self._added: dict[str, SeqItem] = {}
        self._groups: set[str] = set()
        self._released: list[Round] = []
        self._formed = 0
        self._overlapped = 0

    # ---- the step protocol -------------------------------------------------------------

    def begin_step(self, step: int, version: int) -> None:
        """Open step `step`; every item added until finish_step must carry `version`."""
        if self._open:
            raise SchedulerError(f"begin_step({step}): step {self._step} is still open (call finish_step first)")
        self._reset()
        self._step, self._version, self._open = step, version, True

    def add_group(self, items: Iterable[SeqItem]) -> None:
        """Hand over one complete group; with overlap, rounds it completes become ready."""
        items = list(items)
        self._check_group(items)
        for item in items:
            self._added[item.key] = item
        self._groups.add(items[0].group_id)
        policy = items[0].policy
        self._buffers[policy].extend(items)
        if self.config.overlap:
            self._form_ready_rounds(policy)

    def pop_ready(self) -> list[Round]:
        """Rounds worth training now, oldest first; empty without overlap."""
        rounds = list(self._ready)
        self._ready.clear()
        self._overlapped += len(rounds)
        self._released.extend(rounds)
        return rounds

    def finish_step(self) -> list[Round]:
        """Everything not yet released, packed; then checks the step and closes it."""
        if not self._open:
            raise SchedulerError("finish_step() without an open step (call begin_step first)")
        rounds = list(self._ready)
        self._ready.clear()
        for policy in self.policies:
            items, self._buffers[policy] = self._buffers[policy], []
            rounds += self._make_rounds(policy, pack(items, token_budget=self.config.token_budget,
                                                      max_sequences=self.config.max_sequences), final=True)
        self._released.extend(rounds)
        self._check_released()
        self._open = False
        return rounds

    @property
    def buffered_tokens(self) -> int:
        """Tokens added but not yet formed into rounds."""
        return sum(item.num_tokens for items in self._buffers.values() for item in items)

    def report(self) -> StepReport:
        """Figures of the current (or last finished) step, over the rounds released so far."""
        if self._step is None:
            raise SchedulerError("report() before the first begin_step")
        slots = [mb for r in self._released for mb in r.micro_batches]
        tokens = sum(mb.num_tokens for mb in slots)
        capacity = sum(max(self.config.token_budget, mb.num_tokens) for mb in slots)
        lockstep = sum(self.dp_size * r.max_tokens for r in self._released)
        return StepReport(step=self._step, version=self._version,
                          items=sum(len(mb.items) for mb in slots), tokens=tokens,
                          rounds=len(self._released), rounds_overlapped=self._overlapped,
                          micro_batches=len(slots), empty_micro_batches=sum(not mb.items for mb in slots),
                          fill_fraction=tokens / capacity if capacity else 0.0,
                          idle_fraction=1.0 - tokens / lockstep if lockstep else 0.0)

    # ---- internals ---------------------------------------------------------------------

    def _check_group(self, items: list[SeqItem]) -> None:
        if not self._open:
            raise SchedulerError("add_group() outside a step: call begin_step(step, version) first")
        if not items:
            raise SchedulerError("add_group() got an empty group")
        first = items[0]
        if first.group_id in self._groups:
            raise SchedulerError(f"group {first.group_id!r} was already added in step {self._step}")
        if first.policy not in self._buffers:
            raise SchedulerError(f"group {first.group_id!r}: unknown policy {first.policy!r} "
                                 f"(known: {', '.join(self.policies)})")
        keys = set()
        for item in items:
            if item.group_id != first.group_id or item.policy != first.policy:
                raise SchedulerError(f"item {item.key!r} ({item.group_id!r}, policy {item.policy!r}) is not part "
                                     f"of group {first.group_id!r} (policy {first.policy!r})")
            if item.version != self._version:
                raise SchedulerError(f"item {item.key!r} was generated by weight version {item.version}, step "
                                     f"{self._step} trains version {self._version}: no sample from another "
                                     f"policy version")
            if item.key in self._added or item.key in keys:
                raise SchedulerError(f"duplicate item key {item.key!r} in step {self._step}")
            keys.add(item.key)

    def _form_ready_rounds(self, policy: str) -> None:
        budget, cap = self.config.token_budget, self.config.max_sequences
        bins = pack(self._buffers[policy], token_budget=budget, max_sequences=cap)
        # Every micro-batch but the last closed because no item of the buffer fitted; the
        # last one may only have run out of items, so it counts only when full.
        if bins and not _is_full(bins[-1], budget, cap):
            bins = bins[:-1]
        chosen = self._balanced_runs(sorted(bins, key=_cost, reverse=True))
        if not chosen:
            return
        taken = {item.key for mb in chosen for item in mb}
        self._buffers[policy] = [item for item in self._buffers[policy] if item.key not in taken]
        self._ready.extend(self._make_rounds(policy, chosen, final=False))

    def _balanced_runs(self, bins: list[list[SeqItem]]) -> list[list[SeqItem]]:
        """Runs of `dp_size` consecutive micro-batches of `bins` (largest cost first) whose
        smallest costs at least round_balance x their largest, largest runs first."""
        chosen, start = [], 0
        while start + self.dp_size <= len(bins):
            run = bins[start: start + self.dp_size]
            if _cost(run[-1]) >= self.config.round_balance * _cost(run[0]):
                chosen += run
                start += self.dp_size
            else:
                start += 1
        return chosen

    def _make_rounds(self, policy: str, bins: list[list[SeqItem]], *, final: bool) -> list[Round]:
        bins = sorted(bins, key=_cost, reverse=True)
        rounds = []
        for start in range(0, len(bins), self.dp_size):
            chunk = bins[start: start + self.dp_size]
            if len(chunk) < self.dp_size:
                assert final, "only finish_step forms partial rounds"
                chunk = self._spread(chunk)
            mbs = [MicroBatch(policy=policy, items=list(b)) for b in chunk]
            rounds.append(Round(policy=policy, micro_batches=mbs, step=self._step, index=self._formed))
            self._formed += 1
        return rounds

    def _spread(self, chunk: list[list[SeqItem]]) -> list[list[SeqItem]]:
        """The items of a partial round over all dp_size ranks (longest first onto the least
        loaded rank); keeps the packed micro-batches if spreading would break a limit."""
        budget, cap = self.config.token_budget, self.config.max_sequences
        spread: list[list[SeqItem]] = [[] for _ in range(self.dp_size)]
        for item in sorted((i for b in chunk for i in b), key=lambda i: i.num_tokens, reverse=True):
            target = min(spread, key=lambda b: (_cost(b), len(b)))
            if target and not _fits(len(target) + 1, _cost(target) + item.num_tokens, budget, cap):
                return chunk + [[] for _ in range(self.dp_size - len(chunk))]
            target.append(item)
        return spread

    def _check_released(self) -> None:
        seen: dict[str, int] = {}
        for item in (i for r in self._released for i in r.items):
            seen[item.key] = seen.get(item.key, 0) + 1
        twice = sorted(k for k, n in seen.items() if n > 1)
        missing = sorted(set(self._added) - set(seen))
        extra = sorted(set(seen) - set(self._added))
        if twice or missing or extra:
            raise RuntimeError(f"step {self._step}: items released twice {twice[:5]}, never released "
                               f"{missing[:5]}, never added {extra[:5]} (scheduler bug)")
        for r in self._released:
            if len(r.micro_batches) != self.dp_size or any(mb.policy != r.policy for mb in r.micro_batches):
                raise RuntimeError(f"step {self._step}: round {r.index} is malformed (scheduler bug)")


def micro_batch_tokens(lengths: Iterable[int]) -> int:
    """What a micro-batch of sequences of `lengths` tokens costs against the token budget: the
    trainer packs them into one row (megatron/actor.py pack_sequences), so it computes the sum
    of their lengths. The one definition of the cost; it is additive (`pack` relies on that)."""
    return sum(lengths)


def pack(items: Sequence[SeqItem], *, token_budget: int, max_sequences: int | None = None) -> list[list[SeqItem]]:
    """Bin-at-a-time best-fit decreasing: each micro-batch opens with the longest item left and
    takes the longest item that still fits in what the budget leaves until none does (or it
    holds `max_sequences`). Ties go to the earlier item. Returns the micro-batches in the order
    they were opened, each longest first."""
    left = sorted(items, key=lambda item: -item.num_tokens)  # stable: earlier items first on ties
    keys = [-item.num_tokens for item in left]  # ascending, for bisect
    bins = []
    while left:
        mb = [left.pop(0)]
        keys.pop(0)
        cost = _cost(mb)
        while left and (max_sequences is None or len(mb) < max_sequences):
            # the cost is additive, so the longest item that fits is the first one no longer than
            # the room left (the earliest of equals): O(log n) instead of a scan of `left`
            i = bisect.bisect_left(keys, -(token_budget - cost))
            if i == len(left) or not _fits(len(mb) + 1, cost + left[i].num_tokens, token_budget, max_sequences):
                break
            mb.append(left.pop(i))
            keys.pop(i)
            cost += _cost(mb[-1:])  # additive: the new item's cost on top
        bins.append(mb)
    return bins


def _fits(count: int, tokens: int, budget: int, cap: int | None) -> bool:
    """Whether a micro-batch may hold `count` sequences of `tokens` tokens in all."""
    return tokens <= budget and (cap is None or count <= cap)


def _cost(items: Sequence[SeqItem]) -> int:
    return micro_batch_tokens(item.num_tokens for item in items)


def _is_full(items: Sequence[SeqItem], budget: int, cap: int | None) -> bool:
    """No sequence as short as its shortest can join without breaking the budget or the cap."""
    shortest = min(item.num_tokens for item in items)
    return not _fits(len(items) + 1, _cost(items) + shortest, budget, cap)
