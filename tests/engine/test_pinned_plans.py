"""Plans pinned before the architecture redesign (issue 10) must come out bit for bit the same."""

from __future__ import annotations

import json

import pytest

from make_pinned_plans import ALLOCATIONS, CASES, METHODS, PINNED, pinned_stats, plan_record

PLANS = json.loads(PINNED.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_plans_equal_those_pinned_before_the_redesign(case):
    stats = pinned_stats(case)
    for method in METHODS:
        for allocation in ALLOCATIONS:
            key = f"{case}/{method}/{allocation}"
            # JSON round trip: floats compare by their exact shortest repr, as pinned.
            assert json.loads(json.dumps(plan_record(stats, method, allocation))) == PLANS[key], key


def test_every_pinned_plan_is_checked():
    assert sorted(PLANS) == sorted(f"{c}/{m}/{a}" for c in CASES for m in METHODS for a in ALLOCATIONS)
