"""Plans pinned before the architecture redesign (issue 10) must come out the same.

Kept experts and orderings must be identical; curves and cost equal to 1e-6 relative. The statistics come from a
float32 forward of a seeded tiny model, whose last bits depend on the CPU's kernels (the pinned file was written on
an Intel CPU; an AMD EPYC gives curves about 1e-8 apart), so exact float equality would test the machine.
"""

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
            got, pinned = plan_record(stats, method, allocation), PLANS[key]
            assert [(layer["name"], layer["kept"], layer["order"]) for layer in got["layers"]] == [
                (layer["name"], layer["kept"], layer["order"]) for layer in pinned["layers"]], key
            for field in ("residual", "coverage"):
                assert [layer[field] for layer in got["layers"]] == [
                    pytest.approx(layer[field], rel=1e-6, abs=1e-12) for layer in pinned["layers"]], (key, field)
            assert got["cost"] == pytest.approx(pinned["cost"], rel=1e-6), key


def test_every_pinned_plan_is_checked():
    assert sorted(PLANS) == sorted(f"{c}/{m}/{a}" for c in CASES for m in METHODS for a in ALLOCATIONS)
