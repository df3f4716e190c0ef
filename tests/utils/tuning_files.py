"""The configs of the committed tuning files, for tests that run each one under the interpreter."""
from __future__ import annotations

import json


def committed_configs(op: str) -> list[dict]:
    """Every distinct config of ``op`` in ``tuning_configs/<device>/<op>.json``, across devices, shapes and M."""
    from loraplex.kernels import tuning

    seen: list[dict] = []
    for path in sorted(tuning._REPO_TUNING_DIR.glob(f"*/{op}.json")):
        for by_m in json.loads(path.read_text(encoding="utf-8")).values():
            for cfg in by_m.values():  # one shape's M often share a config: each is run once
                if cfg not in seen:
                    seen.append(cfg)
    return seen


def config_id(value) -> str:
    """A pytest id: an op name as it is, a config as its values joined."""
    return value if isinstance(value, str) else "-".join(str(v) for v in value.values())
