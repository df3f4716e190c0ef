"""The scenarios of ``loraplex bench serve`` as engine phases and the measured runs of each.

    for phase in phases(cfg, precision="bf16", adapter_bytes=708 << 20):
        target.start_phase(phase)                      # in process: a new engine with the phase's settings
        runs, row = RunSequence(phase.runs()), None
        while (m := runs.next(row)) is not None:       # a sweep level's ramp uses the previous level's row
            row = target.measure(m, deadline)

load      per variant (base-only, N adapters), per level C in ascending order: a closed loop of C clients,
          max(num_requests, requests_per_client x C) requests, the first requests spread over the ramp
churn     one engine with every adapter resident, one with the budget (adapter memory or slots), the same load
fairness  per scheduling policy: the light tenant alone (first phase only: one tenant schedules the same under
          every policy), then beside the heavy tenant, once per heavy ``n``

End to end (``--url``) the deployment is what it is: one phase, the same runs (churn: one run over the adapters).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator

from loraplex.bench.arrivals import arrival_times
from loraplex.bench.config import ServeBenchConfig
from loraplex.bench.driver import LoadGroup
from loraplex.bench.engine_knobs import optional_engine_kwargs
from loraplex.bench.measure import Measurement, auto_ramp
from loraplex.bench.workload import PlannedRequest, request_plan

FAIRNESS_TIME_S = 30.0   # the light tenant's window when no scenario time is given
LIGHT, HEAVY = "light", "heavy"

Runs = Generator[Measurement, "dict | None", None]


@dataclass
class Phase:
    label: str                                   # report["engine"] key and the rows' name prefix
    runs: Callable[[], Runs]
    quantization: str | None = None
    max_loras: int | None = None
    engine_extra: dict = field(default_factory=dict)   # engine_knobs keywords
    description: str = ""


class RunSequence:
    """Steps a phase's runs: ``next(previous_row)`` -> the next Measurement, or None when there is none."""

    def __init__(self, runs: Runs) -> None:
        self._runs, self._started = runs, False

    def next(self, previous: dict | None) -> Measurement | None:
        try:
            if not self._started:
                self._started = True
                return next(self._runs)
            return self._runs.send(previous)
        except StopIteration:
            return None


def _vocab(cfg: ServeBenchConfig) -> int:
    from loraplex.bench.workload import SCALES

    return cfg.vocab_size or SCALES[cfg.scale]["vocab_size"]


def _stagger(cfg: ServeBenchConfig, level: int, previous: dict | None) -> float:
    if cfg.ramp is None:
        return cfg.stagger_s
    ramp = auto_ramp(previous, cfg.output_len, cfg.scenario_time_s) if cfg.ramp == "auto" else float(cfg.ramp)
    return ramp / level


def load_runs(cfg: ServeBenchConfig, label: str) -> Runs:
    """Per variant and level (module docstring)."""
    variants = ([("base-only", 0)] if cfg.base_only else []) + \
        ([(f"{cfg.num_adapters} adapters r{cfg.rank}", cfg.num_adapters)] if cfg.num_adapters else [])
    for k, (variant, n) in enumerate(variants):
        previous = None
        for level in cfg.levels:
            plan = request_plan(num_requests=cfg.requests_at(level), num_adapters=n, mix=cfg.mix,
                                input_len=cfg.input_len, vocab=_vocab(cfg), seed=cfg.seed + k)
            stagger = _stagger(cfg, level, previous)  # every sample of a level ramps as its first
            name = f"{label} {variant}" + (f" C={level}" if cfg.sweep else "")
            for sample in range(1, cfg.repeats + 1):
                last = yield Measurement(
                    name + (f" #{sample}" if cfg.repeats > 1 else ""),
                    [LoadGroup("load", plan, cfg.output_len, concurrency=level, stagger_s=stagger)], "load",
                    level, cfg.input_len, cfg.output_len, variant=variant, warmup_requests=max(level, n),
                    warmup_adapters=n, time_s=cfg.scenario_time_s, phase=label,
                    extra={"ramp_s": stagger * level, "mix": cfg.mix if n else None, "sample": sample})
            previous = last


def churn_runs(cfg: ServeBenchConfig, label: str) -> Runs:
    n = cfg.num_adapters
    plan = request_plan(num_requests=cfg.requests_at(cfg.concurrency), num_adapters=n, mix=cfg.mix,
                        input_len=cfg.input_len, vocab=_vocab(cfg), seed=cfg.seed)
    yield Measurement(f"{label} {n} adapters r{cfg.rank}",
                      [LoadGroup("load", plan, cfg.output_len, concurrency=cfg.concurrency,
                                 stagger_s=_stagger(cfg, cfg.concurrency, None))],
                      "load", cfg.concurrency, cfg.input_len, cfg.output_len, variant=label.split(" ", 1)[-1],
                      warmup_requests=max(cfg.concurrency, n), warmup_adapters=n, time_s=cfg.scenario_time_s,
                      phase=label, extra={"mix": cfg.mix})


def _tenant_plan(cfg: ServeBenchConfig, count: int, adapter: int | None, input_len: int, seed: int) -> list:
    plan = request_plan(num_requests=count, num_adapters=0, mix="even", input_len=input_len, vocab=_vocab(cfg),
                        seed=seed)
    return [PlannedRequest(p.index, p.prompt, adapter) for p in plan]


def fairness_runs(cfg: ServeBenchConfig, label: str, *, with_alone: bool) -> Runs:
    window = cfg.scenario_time_s or FAIRNESS_TIME_S
    light_in = cfg.light_input_len or cfg.input_len
    light_out = cfg.light_output_len or cfg.output_len
    light_adapter = 0 if cfg.num_adapters else None
    heavy_adapter = (1 if cfg.num_adapters > 1 else 0) if cfg.num_adapters else None
    times = arrival_times(rate=cfg.light_rate, duration=window, kind=cfg.arrivals, seed=cfg.seed)
    light_plan = _tenant_plan(cfg, len(times), light_adapter, light_in, cfg.seed + 1)

    def light() -> LoadGroup:
        return LoadGroup(LIGHT, light_plan, light_out, arrivals=times, tenant=LIGHT, weight=cfg.light_weight)

    common = dict(primary=LIGHT, concurrency=0, input_len=light_in, output_len=light_out, time_s=window,
                  hard_s=3 * window, background_s=2 * window, phase=label, warmup_requests=max(2, min(cfg.concurrency, 16)),
                  warmup_adapters=min(2, cfg.num_adapters))
    info = {"light_rate": cfg.light_rate, "arrivals": cfg.arrivals, "window_s": window}
    if with_alone:
        yield Measurement(f"{label} light alone", [light()], variant="light alone", extra=dict(info), **common)
    for n in cfg.heavy_n:
        if cfg.heavy_concurrency is not None:
            heavy_plan = _tenant_plan(cfg, max(cfg.heavy_concurrency * 4, 64), heavy_adapter, cfg.input_len,
                                      cfg.seed + 2)
            heavy = LoadGroup(HEAVY, heavy_plan, cfg.output_len, concurrency=cfg.heavy_concurrency, n=n,
                              tenant=HEAVY, weight=cfg.heavy_weight, background=True)
            how = f"closed loop of {cfg.heavy_concurrency}"
        else:
            h_times = arrival_times(rate=cfg.heavy_factor * cfg.light_rate, duration=window, kind=cfg.arrivals,
                                    seed=cfg.seed + 7)
            heavy_plan = _tenant_plan(cfg, len(h_times), heavy_adapter, cfg.input_len, cfg.seed + 2)
            heavy = LoadGroup(HEAVY, heavy_plan, cfg.output_len, arrivals=h_times, n=n, tenant=HEAVY,
                              weight=cfg.heavy_weight, background=True)
            how = f"{cfg.heavy_factor:g} x the light rate"
        suffix = f" n={n}" if n > 1 else ""
        yield Measurement(f"{label} light beside heavy{suffix}", [light(), heavy], variant=f"beside heavy{suffix}",
                          extra=dict(info, heavy=how, heavy_n=n), **common)


def phases(cfg: ServeBenchConfig, *, precision: str, adapter_bytes: int) -> list[Phase]:
    """The engine phases of ``cfg`` (in process); ``adapter_bytes``: one adapter's GPU bytes (budgets in adapters)."""
    if cfg.end_to_end:
        return [_e2e_phase(cfg)]
    if cfg.hf_only:
        return []
    quant = ([(cfg.quantization, cfg.quantization)] if cfg.quantization is not None
             else [(precision, None)] + ([("int8", "int8")] if cfg.int8 else []))
    out: list[Phase] = []
    for qlabel, q in quant:
        if cfg.scenario == "load":
            out.append(Phase(qlabel, lambda lab=qlabel: load_runs(cfg, lab), quantization=q))
        elif cfg.scenario == "churn":
            n = cfg.num_adapters
            by_bytes = cfg.adapter_budget is not None or cfg.adapter_memory_gib is not None
            if cfg.adapter_budget is not None:
                budget_bytes, what = cfg.adapter_budget * adapter_bytes, f"budget {cfg.adapter_budget}"
            elif cfg.adapter_memory_gib is not None:
                budget_bytes, what = int(cfg.adapter_memory_gib * 2**30), f"budget {cfg.adapter_memory_gib:g} GiB"
            else:
                budget_bytes, what = None, f"{cfg.max_loras} slots"
            full = optional_engine_kwargs(adapter_memory_bytes=n * adapter_bytes if by_bytes else None)
            tight = optional_engine_kwargs(adapter_memory_bytes=budget_bytes)
            label_all, label_tight = f"{qlabel} all-resident", f"{qlabel} {what}"
            out.append(Phase(label_all, lambda lab=label_all: churn_runs(cfg, lab), quantization=q, max_loras=n,
                             engine_extra=full, description=f"all {n} adapters fit"))
            out.append(Phase(label_tight, lambda lab=label_tight: churn_runs(cfg, lab), quantization=q,
                             max_loras=cfg.max_loras or n, engine_extra=tight,
                             description=f"{what} for {n} adapters"))
        else:
            policies = cfg.scheduling_policies or (None,)
            for i, policy in enumerate(policies):
                lab = f"{qlabel} {policy}" if policy else qlabel
                out.append(Phase(lab, lambda lab=lab, first=(i == 0): fairness_runs(cfg, lab, with_alone=first),
                                 quantization=q, engine_extra=optional_engine_kwargs(scheduling_policy=policy),
                                 description=f"scheduling policy {policy or 'the engine default'}"))
    return out


def _e2e_phase(cfg: ServeBenchConfig) -> Phase:
    lab = "e2e"
    if cfg.scenario == "load":
        return Phase(lab, lambda: load_runs(cfg, lab), description="through the platform")
    if cfg.scenario == "churn":
        return Phase(lab, lambda: churn_runs(cfg, lab), description="the deployment's adapter budget")
    return Phase(lab, lambda: fairness_runs(cfg, lab, with_alone=True), description="the deployment's policy")
