"""The engine's scheduler as pure functions: admission in order while pages and max_running
allow, while this step's prefill budget has a token left, and not past a request whose first
uncached page is being computed; the step's budget with and without decodes; the prefill
budget spent in admission order with the first request that does not fit cut there, and the
budgets' checks (at the limit and one past it)."""

from __future__ import annotations

import pytest

from stepgraph.engine.scheduler import (
    Candidate,
    ChunkPlan,
    admit_count,
    check_budget,
    plan_admission,
    plan_prefill,
    step_prefill_budget,
)
from stepgraph.errors import ConfigError


@pytest.mark.parametrize(
    "needs, free, running, max_running, want",
    [
        ([2, 3, 4], 9, 0, None, 3),  # exactly every page
        ([2, 3, 4], 8, 0, None, 2),  # one page short for the third
        ([5, 1, 1], 4, 0, None, 0),  # first come, first served: the head blocks the rest
        ([1, 1, 1], 10, 2, 3, 1),  # max_running counts the running requests
        ([1, 1, 1], 10, 3, 3, 0),
        ([1, 1, 1], 10, 0, 2, 2),
        ([], 10, 0, None, 0),
    ],
)
def test_admit_count(needs, free, running, max_running, want):
    assert admit_count(iter(needs), free, running, max_running) == want


def test_plan_fills_the_budget_in_order_and_cuts_the_first_that_does_not_fit():
    plan = plan_prefill([(0, 5), (0, 7), (0, 3)], 10)
    assert plan == [ChunkPlan(0, 0, 5, True), ChunkPlan(1, 0, 5, False)]


def test_plan_continues_a_cut_prompt_from_where_it_stopped():
    assert plan_prefill([(5, 7), (0, 3)], 10) == [
        ChunkPlan(0, 5, 2, True),
        ChunkPlan(1, 0, 3, True),
    ]


@pytest.mark.parametrize("budget, want_last", [(12, True), (11, False)])
def test_plan_at_the_budget_and_one_below(budget, want_last):
    plan = plan_prefill([(0, 12)], budget)
    assert plan == [ChunkPlan(0, 0, min(12, budget), want_last)]


def test_budget_one_prefills_one_token_a_step():
    pending, steps = [(0, 4)], []
    while pending:
        (c,) = plan_prefill(pending, 1)
        steps.append((c.start, c.length, c.last))
        pending = [] if c.last else [(c.start + c.length, 4)]
    assert steps == [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, True)]


def test_plan_of_nothing_is_empty():
    assert plan_prefill([], 8) == []


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_budget_checks(bad):
    with pytest.raises(ConfigError, match="max_prefill_tokens must be an integer >= 1"):
        check_budget(bad)
    check_budget(1)  # the smallest budget


def test_a_request_already_prefilled_is_a_bug():
    with pytest.raises(ConfigError, match="request 0 has 3 of 3"):
        plan_prefill([(3, 3)], 8)


def _plan(cands, free=100, running=0, max_running=None, budget=100, computing=()):
    return plan_admission(iter(cands), free, running, max_running, budget, computing)


@pytest.mark.parametrize(
    "tokens, budget, want",
    [
        ([4, 6, 1], 10, (2, "budget")),  # the budget exactly spent: the third waits
        ([4, 6, 2, 9], 11, (3, "budget")),  # one token left: the third starts (one of its 2)
        ([4, 7, 1], 10, (2, "budget")),  # the second is cut at the budget, still admitted
        ([4], 0, (0, "budget")),  # running requests' chunks took it all
        ([4], -3, (0, "budget")),
        ([4, 1], 5, (2, "budget")),
        ([4, 1], 6, (2, "queue")),
    ],
)
def test_admission_stops_where_the_prefill_budget_is_spent(tokens, budget, want):
    assert _plan([Candidate(1, t) for t in tokens], budget=budget) == want


@pytest.mark.parametrize(
    "pages, free, want",
    [([2, 3, 4], 9, (3, "queue")), ([2, 3, 4], 8, (2, "pages")), ([5, 1], 4, (0, "pages"))],
)
def test_admission_counts_pages_at_the_limit_and_one_past(pages, free, want):
    assert _plan([Candidate(p, 1) for p in pages], free=free) == want


def test_admission_keeps_max_running():
    cands = [Candidate(1, 1)] * 3
    assert _plan(cands, running=2, max_running=3) == (1, "running")
    assert _plan(cands, running=3, max_running=3) == (0, "running")
    assert _plan(cands, max_running=None) == (3, "queue")


def test_a_request_waits_for_the_page_a_request_admitted_before_it_computes():
    a = Candidate(3, 40, waits_on="p0", computes="p0")  # the group's first: computes page p0
    b = Candidate(3, 40, waits_on="p0", computes="p0")  # its group-mate
    c = Candidate(3, 40, waits_on="q0", computes="q0")  # another group
    assert _plan([a, b, c]) == (1, "computing")  # first come, first served: c waits too
    assert _plan([a, c, b]) == (2, "computing")
    # the next round: a is prefilling (p0 in flight), b still waits; once a's pages are
    # cached, b's first uncached page is another one, and b goes first
    assert _plan([b, c], computing=["p0"]) == (0, "computing")
    b_hits = Candidate(1, 8, waits_on="b5", computes="b5")
    assert _plan([b_hits, c], computing=["q7"]) == (2, "queue")


def test_a_request_that_computes_what_nobody_waits_on_blocks_nothing():
    last = Candidate(2, 16, waits_on=None, computes="p1")  # its last page: it never matches it
    assert _plan([last], computing=["p1"]) == (1, "queue")
    partial = Candidate(2, 5, waits_on=None, computes=None)  # only a partial page left
    assert _plan([Candidate(2, 5, computes="x"), partial]) == (2, "queue")


def test_admission_reads_the_queue_one_past_the_last_admitted():
    seen = []

    def queue():
        for i in range(100):
            seen.append(i)
            yield Candidate(1, 10)

    assert plan_admission(queue(), 100, 0, None, 25, ()) == (3, "budget")
    assert seen == [0, 1, 2]  # the budget was spent at the third: the fourth is never built
    seen.clear()
    assert plan_admission(queue(), 2, 0, None, 100, ()) == (2, "pages")
    assert seen == [0, 1, 2]


@pytest.mark.parametrize(
    "most, with_decode, decoding, want",
    [
        (8192, 2048, True, 2048),
        (8192, 2048, False, 8192),  # nothing decodes: the whole budget
        (1024, 2048, True, 1024),  # the cap never raises the budget
        (8192, None, True, 8192),  # no cap
        (2048, 2048, True, 2048),
        (2049, 2048, True, 2048),
    ],
)
def test_a_step_that_decodes_prefills_at_most_its_cap(most, with_decode, decoding, want):
    assert step_prefill_budget(most, with_decode, decoding) == want


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_the_cap_checks_name_it(bad):
    with pytest.raises(ConfigError, match="max_prefill_tokens_with_decode must be an integer"):
        check_budget(bad, "max_prefill_tokens_with_decode")
    check_budget(1, "max_prefill_tokens_with_decode")
