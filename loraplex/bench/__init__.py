"""``loraplex bench``: in-process serving benchmarks of the engine (workloads, closed-loop driver, reports)."""
