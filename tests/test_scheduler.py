"""The engine's scheduler as pure functions: admission in order while pages and max_running
allow, the prefill budget spent in admission order with the first request that does not fit
cut there, and the budget's checks (at the limit and one past it)."""

from __future__ import annotations

import pytest

from stepgraph.engine.scheduler import ChunkPlan, admit_count, check_budget, plan_prefill
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
