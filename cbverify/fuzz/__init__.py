"""``cbverify fuzz``: a Hypothesis search over an engine's configuration and call-pattern space.

``case`` (a fuzz case as data) <- ``strategies`` (drawing cases) -> ``drivers`` (running a case's calls on one engine
as its API's user would) -> ``judge`` (the suite's comparisons against the oracle) -> ``run`` (one case end to end)
-> ``search`` (explore, shrink, classify against ``findings``) -> ``repro`` (standalone scripts + JSON records).
"""
