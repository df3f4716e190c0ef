"""Runs the Locust users headless for a while and appends their records to a JSONL file.

    LORAPLEX_LOAD_CONFIG=cfg.json python -m load_tests.locust_worker

Its own process, because importing Locust monkey-patches the standard library with gevent.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> int:
    cfg = json.load(open(os.environ["LORAPLEX_LOAD_CONFIG"]))
    import gevent
    from locust.env import Environment

    from load_tests import locust_users as lu

    classes = [c for c in (lu.ZipfUser, lu.BurstUser, lu.ChurnUser, lu.LongPromptUser) if c.weight > 0]
    if not classes:
        print("no scenario has a weight > 0", file=sys.stderr)
        return 2
    for c in classes:
        if c is not lu.ZipfUser:
            c.fixed_count = 1     # one user each for the side scenarios; Zipf users take the rest
    if cfg["users"] < len(classes):
        print(f"need at least {len(classes)} users for {len(classes)} scenarios", file=sys.stderr)
        return 2
    env = Environment(user_classes=classes, host=cfg["url"])
    runner = env.create_local_runner()
    if cfg.get("pause_file"):
        gevent.spawn(lu.watch_pause, cfg["pause_file"], cfg["records"])
    runner.start(cfg["users"], spawn_rate=cfg.get("spawn_rate", cfg["users"]))
    gevent.sleep(cfg["duration_s"])
    runner.quit()   # stops users (in-flight requests are cut: their records are not written)
    lu.flush_records(cfg["records"])
    print(json.dumps({"records": len(lu.RECORDS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
