"""Stage 2, plan: from the statistics alone, each method orders every layer's experts and an allocation spreads the
budget across layers into a :class:`~ompmoe.engine.planning.plan.PruningPlan` (no model needed: microseconds)."""
