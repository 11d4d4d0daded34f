"""The agentic micro-batch scheduler: packing invariants under the packed cost (the sum of the
lengths), the step contract, and overlap with a simulated rollout (groups finishing at
simulated times, training time proportional to tokens)."""
import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_marsrl.rl.scheduler import (MicroBatch, MicroBatchScheduler, SchedulerConfig, SchedulerError,
                                          SeqItem, micro_batch_tokens, pack)


def group(gid, sizes, *, policy="shared", version=0):
    return [SeqItem(key=f"{gid}/{i}", policy=policy, num_tokens=n, version=version, group_id=gid)
            for i, n in enumerate(sizes)]


def scheduler(budget=100, *, dp=2, policies=("shared",), overlap=True, max_sequences=None, round_balance=0.9):
    config = SchedulerConfig(token_budget=budget, overlap=overlap, max_sequences=max_sequences,
                             round_balance=round_balance)
    return MicroBatchScheduler(config, dp_size=dp, policies=policies)


def cost(items):
    """What the trainer computes for a micro-batch: its sequences packed into one row."""
    return sum(i.num_tokens for i in items)


def check_rounds(rounds, sched, *, finish_from):
    """Shape and packing invariants; rounds before index `finish_from` came from pop_ready."""
    cfg = sched.config
    for n, r in enumerate(rounds):
        assert r.index == n
        assert len(r.micro_batches) == sched.dp_size
        assert all(mb.policy == r.policy for mb in r.micro_batches)
        assert all(item.policy == r.policy for item in r.items)
        for mb in r.micro_batches:
            assert cost(mb.items) <= cfg.token_budget or len(mb.items) == 1
            assert mb.num_tokens == cost(mb.items)
            assert cfg.max_sequences is None or len(mb.items) <= cfg.max_sequences
            if n < finish_from:
                assert mb.items, "rounds released during the step never hold empty micro-batches"
        if n < finish_from:
            costs = [cost(mb.items) for mb in r.micro_batches]
            assert min(costs) >= cfg.round_balance * max(costs)


# ---- packing ---------------------------------------------------------------------------

def test_pack_fills_to_budget_and_isolates_oversized_items():
    # best-fit decreasing: 70 is topped up with the longest item that fits (30), 60 with 40
    bins = pack(group("g", [60, 40, 30, 70, 250, 10]), token_budget=100)
    assert [[i.num_tokens for i in b] for b in bins] == [[250], [70, 30], [60, 40], [10]]
    bins = pack(group("g", [10] * 7), token_budget=100, max_sequences=3)
    assert [len(b) for b in bins] == [3, 3, 1]
    assert [len(b) for b in pack(group("g", [10] * 23), token_budget=100)] == [10, 10, 3]


def test_a_long_sequence_shares_a_micro_batch_with_short_ones():
    # the case at 1/1000 scale: 60 + 4 x 2 tokens packed into one row cost 68 (padded
    # to [5, 60] rows they allocated 300, so the padded rule kept 60 alone)
    items = group("g", [60, 2, 2, 2, 2])
    assert [[i.num_tokens for i in b] for b in pack(items, token_budget=68)] == [[60, 2, 2, 2, 2]]
    bins = pack(items, token_budget=64)
    assert [[i.num_tokens for i in b] for b in bins] == [[60, 2, 2], [2, 2]]
    s = scheduler(64, dp=2)
    s.begin_step(0, 0)
    s.add_group(items)
    rounds = s.pop_ready() + s.finish_step()
    assert sorted(mb.num_tokens for r in rounds for mb in r.micro_batches) == [4, 64]


def test_micro_batch_cost_is_the_sum_of_the_lengths():
    mb = MicroBatch(policy="p", items=group("g", [60, 2, 2]))
    assert mb.num_tokens == micro_batch_tokens([60, 2, 2]) == 64
    assert MicroBatch(policy="p").num_tokens == 0
    # the dry run's bound: the budget, or one sequence longer than it alone
    assert SchedulerConfig(token_budget=100).max_micro_batch_tokens(60) == 100
    assert SchedulerConfig(token_budget=100).max_micro_batch_tokens(250) == 250


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), max_size=40), budget=st.integers(1, 400),
       max_sequences=st.one_of(st.none(), st.integers(1, 6)))
def test_pack_respects_the_budget_and_fills_each_micro_batch(sizes, budget, max_sequences):
    bins = pack(group("g", sizes), token_budget=budget, max_sequences=max_sequences)
    assert sorted(i.key for b in bins for i in b) == sorted(i.key for i in group("g", sizes))
    for n, b in enumerate(bins):
        assert cost(b) <= budget or len(b) == 1
        assert max_sequences is None or len(b) <= max_sequences
        assert [i.num_tokens for i in b] == sorted((i.num_tokens for i in b), reverse=True)
        later = [i for rest in bins[n + 1:] for i in rest]
        # closed because no item left (all of them went to later micro-batches) fitted
        assert len(b) == max_sequences or all(cost(b) + i.num_tokens > budget for i in later)


def _best_fit_decreasing_by_scan(items, budget, max_sequences):
    """The packing rule spelled out as a plain scan (pack finds the same items by bisection)."""
    left, bins = sorted(items, key=lambda i: -i.num_tokens), []
    while left:
        mb = [left.pop(0)]
        while max_sequences is None or len(mb) < max_sequences:
            fitting = [i for i in left if cost(mb) + i.num_tokens <= budget]
            if not fitting:
                break
            mb.append(fitting[0])
            left.remove(fitting[0])
        bins.append(mb)
    return bins


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), max_size=40), budget=st.integers(1, 150),
       max_sequences=st.one_of(st.none(), st.integers(1, 6)))
def test_pack_takes_the_longest_item_that_fits_like_a_plain_scan(sizes, budget, max_sequences):
    items = group("g", sizes)
    got = pack(items, token_budget=budget, max_sequences=max_sequences)
    want = _best_fit_decreasing_by_scan(items, budget, max_sequences)
    assert [[i.key for i in b] for b in got] == [[i.key for i in b] for b in want]


def test_pack_is_deterministic_and_prefers_earlier_items_on_ties():
    items = group("g", [50, 50, 50])
    assert [i.key for i in pack(items, token_budget=100)[0]] == ["g/0", "g/1"]


# ---- the step contract -------------------------------------------------------------------

def test_rejects_items_from_another_weight_version():
    s = scheduler()
    s.begin_step(3, version=7)
    with pytest.raises(SchedulerError, match="weight version 6.*no sample from another policy version"):
        s.add_group(group("g", [10, 10], version=6))
    s.add_group(group("g", [10, 10], version=7))
    assert sum(len(r.items) for r in s.finish_step()) == 2


@pytest.mark.parametrize("bad, match", [
    (lambda s: s.add_group([]), "empty group"),
    (lambda s: s.add_group(group("g", [5], policy="critic")), "unknown policy 'critic'"),
    (lambda s: s.add_group(group("a", [5]) + group("b", [5])), "not part of group 'a'"),
    (lambda s: s.add_group(group("a", [5]) + group("a", [5])), "duplicate item key 'a/0'"),
    (lambda s: (s.add_group(group("a", [5])), s.add_group(group("a", [6]))), "already added"),
    (lambda s: (s.add_group(group("a", [5])), s.add_group(group("b", [5])[:0] + [
        SeqItem(key="a/0", policy="shared", num_tokens=5, version=0, group_id="b")])), "duplicate item key"),
    (lambda s: s.begin_step(1, 0), "still open"),
])
def test_rejects_contract_violations(bad, match):
    s = scheduler()
    s.begin_step(0, 0)
    with pytest.raises(SchedulerError, match=match):
        bad(s)


def test_call_order_and_config_errors():
    s = scheduler()
    with pytest.raises(SchedulerError, match="call begin_step"):
        s.add_group(group("g", [5]))
    with pytest.raises(SchedulerError, match="without an open step"):
        s.finish_step()
    with pytest.raises(ValueError, match="token_budget=0"):
        SchedulerConfig(token_budget=0)
    with pytest.raises(ValueError, match="max_sequences=0"):
        SchedulerConfig(max_sequences=0)
    with pytest.raises(ValueError, match=r"round_balance=1.5: must be within \[0, 1\]"):
        SchedulerConfig(round_balance=1.5)
    with pytest.raises(SchedulerError, match="num_tokens=0"):
        group("g", [0])
    with pytest.raises(SchedulerError, match="dp_size=0"):
        scheduler(dp=0)
    with pytest.raises(SchedulerError, match="without repeats"):
        scheduler(policies=("a", "a"))


def test_finish_step_detects_a_lost_item():
    s = scheduler()
    s.begin_step(0, 0)
    s.add_group(group("g", [5, 5]))
    s._buffers["shared"].pop()  # simulate a bug that drops an item
    with pytest.raises(RuntimeError, match=r"never released \['g/1'\]"):
        s.finish_step()


def test_rounds_release_once_the_buffer_fills_dp_micro_batches():
    s = scheduler(100, dp=2)
    s.begin_step(0, 0)
    s.add_group(group("a", [50, 30]))
    assert s.pop_ready() == []            # [50, 30] is full (80 + another 30 > 100), but only one
    s.add_group(group("b", [45]))          # [50, 45] full, [30] still open (could take 2 more of 30)
    assert s.pop_ready() == []
    s.add_group(group("c", [35, 25]))      # [50, 45] and [35, 30, 25]: both full, 95 and 90 tokens
    (r,) = s.pop_ready()
    assert sorted(mb.num_tokens for mb in r.micro_batches) == [90, 95]
    assert r.max_tokens == 95 and r.num_tokens == 185
    assert s.buffered_tokens == 0 and s.finish_step() == []
    report = s.report()
    assert (report.items, report.tokens, report.rounds, report.rounds_overlapped) == (5, 185, 1, 1)
    assert report.fill_fraction == pytest.approx(185 / 200)
    assert report.idle_fraction == pytest.approx(1 - 185 / 190)  # the rank with 90 waits for 95


def test_early_rounds_pair_micro_batches_of_similar_cost():
    s = scheduler(100, dp=2)
    s.begin_step(0, 0)
    s.add_group(group("a", [60]))
    s.add_group(group("b", [50, 50]))     # [60] and [50, 50] are full, but a round of them would
    assert s.pop_ready() == []             # keep the rank with 60 waiting for the one with 100
    s.add_group(group("c", [55]))          # [60] and [55] cost within 10% of each other
    (r,) = s.pop_ready()
    assert sorted(mb.num_tokens for mb in r.micro_batches) == [55, 60]
    (last,) = s.finish_step()              # [50, 50] spread over both ranks at the end
    assert sorted(mb.num_tokens for mb in last.micro_batches) == [50, 50]
    eager = scheduler(100, dp=2, round_balance=0.0)
    eager.begin_step(0, 0)
    eager.add_group(group("a", [60]))
    eager.add_group(group("b", [50, 50]))
    (r,) = eager.pop_ready()
    assert sorted(mb.num_tokens for mb in r.micro_batches) == [60, 100]


def test_without_overlap_nothing_is_released_before_finish():
    s = scheduler(100, dp=2, overlap=False)
    s.begin_step(0, 0)
    for g in range(10):
        s.add_group(group(f"g{g}", [50, 50]))
        assert s.pop_ready() == []
    rounds = s.finish_step()
    assert len(rounds) == 5 and s.report().rounds_overlapped == 0


def test_last_round_spreads_its_items_over_all_ranks():
    s = scheduler(100, dp=4)
    s.begin_step(0, 0)
    s.add_group(group("g", [20, 20, 20, 20, 10]))
    (r,) = s.finish_step()
    assert sorted(mb.num_tokens for mb in r.micro_batches) == [20, 20, 20, 30]


def test_multi_policy_rounds_are_single_policy_and_fifo():
    s = scheduler(100, dp=2, policies=("solver", "verifier"))
    s.begin_step(0, 0)
    s.add_group(group("v", [100, 100], policy="verifier"))
    s.add_group(group("s1", [100], policy="solver"))
    s.add_group(group("s2", [100], policy="solver"))
    s.add_group(group("v2", [40], policy="verifier"))
    s.add_group(group("s3", [30], policy="solver"))
    ready = s.pop_ready()
    assert [r.policy for r in ready] == ["verifier", "solver"]
    rest = s.finish_step()
    assert [r.policy for r in rest] == ["solver", "verifier"]  # constructor order at the end
    check_rounds(ready + rest, s, finish_from=2)


def test_steps_are_independent():
    s = scheduler(100, dp=1)
    for step in range(3):
        s.begin_step(step, version=step)
        s.add_group(group("g", [50, 60], version=step))  # same keys every step are fine
        rounds = s.pop_ready() + s.finish_step()
        assert {i.key for r in rounds for i in r.items} == {"g/0", "g/1"}
        assert all(r.step == step for r in rounds)


@settings(max_examples=150, deadline=None)
@given(groups=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(1, 300), min_size=1, max_size=6)),
                       max_size=25),
       budget=st.integers(50, 400), dp=st.integers(1, 4), overlap=st.booleans(),
       max_sequences=st.one_of(st.none(), st.integers(1, 5)), pop_every=st.integers(1, 4),
       round_balance=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_every_item_is_released_exactly_once(groups, budget, dp, overlap, max_sequences, pop_every, round_balance):
    s = scheduler(budget, dp=dp, policies=("a", "b"), overlap=overlap, max_sequences=max_sequences,
                  round_balance=round_balance)
    s.begin_step(5, version=2)
    added, rounds = set(), []
    for n, (policy, sizes) in enumerate(groups):
        items = group(f"g{n}", sizes, policy=policy, version=2)
        added |= {i.key for i in items}
        s.add_group(items)
        if n % pop_every == 0:
            rounds += s.pop_ready()
    rounds += s.pop_ready()
    during = len(rounds)
    rounds += s.finish_step()
    keys = [i.key for r in rounds for i in r.items]
    assert sorted(keys) == sorted(added)
    check_rounds(rounds, s, finish_from=during)
    assert overlap or during == 0
    report = s.report()
    assert report.items == len(added) and report.rounds == len(rounds) and report.rounds_overlapped == during
    assert report.tokens == sum(cost(r.items) for r in rounds)
    assert 0 <= report.idle_fraction < 1 and 0 <= report.fill_fraction <= 1


# ---- overlap with a simulated rollout ----------------------------------------------------

def simulate_step(*, overlap, seed=0, groups=40, group_size=8, dp=4, tokens_per_s=2000.0):
    """Groups finish at random (long-tailed) times; each round takes its largest micro-batch's
    tokens / tokens_per_s on the lockstep ranks, which train one round at a time, FIFO."""
    rng = random.Random(seed)
    arrivals = []
    for g in range(groups):
        sizes = [min(8000, int(rng.lognormvariate(7.0, 0.9)) + 1) for _ in range(group_size)]
        heapq.heappush(arrivals, (max(sizes) / 50.0 + rng.random(), g, sizes))  # the slowest sample decides
    s = scheduler(8192, dp=dp, overlap=overlap)
    s.begin_step(0, 0)
    trainer_free, first_start, trained, last_arrival = 0.0, None, [], 0.0

    def train(rounds, now):
        nonlocal trainer_free, first_start
        for r in rounds:
            start = max(trainer_free, now)
            first_start = start if first_start is None else first_start
            trainer_free = start + r.max_tokens / tokens_per_s
            trained.extend(i.key for i in r.items)

    while arrivals:
        last_arrival, g, sizes = heapq.heappop(arrivals)
        s.add_group(group(f"g{g}", sizes))
        train(s.pop_ready(), last_arrival)
    train(s.finish_step(), last_arrival)
    return {"step_time": trainer_free, "first_train": first_start, "last_arrival": last_arrival,
            "trained": sorted(trained)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_starts_training_early_and_shortens_the_step(seed):
    sync, overlapped = simulate_step(overlap=False, seed=seed), simulate_step(overlap=True, seed=seed)
    assert overlapped["trained"] == sync["trained"]
    assert overlapped["first_train"] < overlapped["last_arrival"]
    assert sync["first_train"] == sync["last_arrival"]
    assert overlapped["step_time"] < sync["step_time"]
