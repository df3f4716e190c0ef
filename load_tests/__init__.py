"""Multi-tenant load scenarios, fault checks and reports over HTTP against a running loraplex platform.

    python -m load_tests.run --scenario all --duration 300 --spawn          # local stack (PG, Redis, S3, engines)
    python -m load_tests.run --scenario zipf --duration 60 --url http://gw:8000 --admin-key ... --engine-url ...

Locust drives request load (``locust_users.py``, run by ``locust_worker.py`` in its own process: Locust
monkey-patches the standard library with gevent); ``streaming.py`` is a plain asyncio client for token timing.
Every run writes ``report.json`` and ``report.md`` (``report.py``); ``invariants.py`` checks that nothing leaked.
``--spawn --faults all``: ``faults.py`` breaks the spawned stack in turn while the load runs, pausing the load
(``gate.py``) to check the invariants after each fault; the report gets a fault matrix.
"""
