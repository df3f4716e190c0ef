"""Host time of the scheduler alone (``Scheduler.schedule`` + ``Scheduler.update``) per step, FCFS against the
tenant-fair VTC policy, at a load the engine must carry: ``--running`` sequences decoding (default 256 =
max_num_seqs), ``--waiting`` requests queued behind them (default 4000), requests finishing and being admitted
every step, prompts chunked under the token budget.

    python3 benchmarks/engine/bench_scheduler_policy.py
    python3 benchmarks/engine/bench_scheduler_policy.py --running 256 --waiting 4000 --steps 400 --tenants 1,16,256,1024
    python3 benchmarks/engine/bench_scheduler_policy.py --vtc-preempt-gap none   # vtc without slot/budget yields

Pure bookkeeping (no torch, no model): a fake model samples a fixed token, the KV pool is large enough that
nothing is preempted. Variants: ``fcfs`` (one queue) and ``vtc`` with 1 and more tenants (requests spread
over them Zipf-like, so a few tenants are heavy), all fed the same request stream. The variants run in lockstep,
one step each in rotating order, so a busy machine slows them alike; times are the thread's CPU time
(``time.thread_time``) and the waiting queue is refilled outside them. A row: per-step median and p90 µs of
schedule and update, their sum, and "vs fcfs", the median over steps of (this variant's step - fcfs's step of
the same index): with one tenant the two schedules are identical step for step, so that is exactly the policy's
own cost; "slot y" and "budg y", the slot preemptions and withdrawn decode entries of the fair policy's yields
during the timed steps (engine/slot_yield.py). Writes ``$OUT/bench_scheduler_policy.json`` (``OUT`` defaults to ``.``). A few minutes on any CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP  # noqa: E402
from loraplex.engine.kv_cache import KVCacheManager  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from loraplex.engine.sequence import SequenceGroup  # noqa: E402

BLOCK = 16


class Workload:
    """One scheduler under the steady load of the module docstring; ``step()`` times one schedule + update."""

    def __init__(self, policy: str, tenants: int, args) -> None:
        self.policy, self.tenants, self.args = policy, tenants, args
        self.rng = random.Random(0)  # the same request stream for every variant
        max_len = args.max_prompt + args.max_tokens
        blocks = (args.running + 64) * ((max_len + BLOCK - 1) // BLOCK)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=args.running, max_num_batched_tokens=args.budget,
                                               max_model_len=max_len + 1, policy=policy, eos_token_ids=[0],
                                               vtc_preempt_gap=args.vtc_preempt_gap),
                               KVCacheManager(blocks, BLOCK, enable_prefix_caching=False))
        self.zipf = [1.0 / (i + 1) for i in range(tenants)]
        self.ids = iter(range(10**9))
        self.t_sched: list[float] = []
        self.t_update: list[float] = []
        self.admitted: list[int] = []
        self.yields_at_start: tuple[int, int] | None = None  # (slot preemptions, budget yields) when timing began
        self.refill()

    def refill(self) -> None:
        args, rng = self.args, self.rng
        while self.sched.num_waiting < args.waiting:
            i = next(self.ids)
            tenant = rng.choices(range(self.tenants), self.zipf)[0]
            prompt = [1 + (i + j) % 997 for j in range(rng.randint(args.min_prompt, args.max_prompt))]
            params = SamplingParams(max_tokens=rng.randint(args.min_tokens, args.max_tokens), ignore_eos=True)
            self.sched.add(SequenceGroup.from_prompt(f"r{i}", prompt, params, arrival_time=float(i),
                                                     tenant=f"t{tenant}", weight=1.0 + tenant % 3))

    def step(self, timed: bool) -> None:
        sched = self.sched
        if timed and self.yields_at_start is None:
            self.yields_at_start = (sched.num_slot_preemptions, sched.num_budget_yields)
        before = sched.num_waiting
        t0 = time.thread_time()
        out = sched.schedule()
        t1 = time.thread_time()
        sampled = {s.seq.seq_id: 7 for s in out.scheduled if s.sample}
        t2 = time.thread_time()
        sched.update(out, sampled)
        t3 = time.thread_time()
        if timed:
            self.t_sched.append((t1 - t0) * 1e6)
            self.t_update.append((t3 - t2) * 1e6)
            self.admitted.append(before - sched.num_waiting)
        self.refill()

    def row(self, base: "Workload") -> dict:
        total = [a + b for a, b in zip(self.t_sched, self.t_update)]
        paired = [a + b - c - d for a, b, c, d in zip(self.t_sched, self.t_update, base.t_sched, base.t_update)]

        def p90(x):
            return statistics.quantiles(x, n=10)[-1]

        slots0, budget0 = self.yields_at_start or (0, 0)
        return {"policy": self.policy, "tenants": self.tenants, "running": self.sched.num_running,
                "steps": len(self.t_sched), "slot_preemptions": self.sched.num_slot_preemptions - slots0,
                "budget_yields": self.sched.num_budget_yields - budget0,
                "waiting": self.sched.num_waiting, "admitted_per_step": statistics.mean(self.admitted),
                "schedule_us_p50": statistics.median(self.t_sched), "schedule_us_p90": p90(self.t_sched),
                "update_us_p50": statistics.median(self.t_update), "step_us_p50": statistics.median(total),
                "step_us_p90": p90(total), "vs_fcfs_us_p50": statistics.median(paired)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=4000)
    p.add_argument("--tenants", default="1,16,256,1024")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--vtc-preempt-gap", type=lambda t: None if t.lower() == "none" else float(t),
                   default=DEFAULT_PREEMPT_GAP, help="vtc's slot/budget yield gap ('none': no yields)")
    args = p.parse_args(argv)
    loads = [Workload("fcfs", 1, args)] + [Workload("vtc", int(t), args) for t in args.tenants.split(",")]
    for k in range(args.warmup + args.steps):  # in lockstep, the order rotating: machine noise hits all alike
        for w in loads[k % len(loads):] + loads[:k % len(loads)]:
            w.step(timed=k >= args.warmup)
    rows = [w.row(loads[0]) for w in loads]
    print(f"{'policy':6} {'tenants':>7} {'running':>7} {'waiting':>7} {'adm/step':>8} {'sched p50':>9} "
          f"{'sched p90':>9} {'upd p50':>8} {'step p50':>8} {'step p90':>8} {'vs fcfs':>8} {'slot y':>6} "
          f"{'budg y':>6}")
    for r in rows:
        print(f"{r['policy']:6} {r['tenants']:7d} {r['running']:7d} {r['waiting']:7d} {r['admitted_per_step']:8.2f} "
              f"{r['schedule_us_p50']:9.1f} {r['schedule_us_p90']:9.1f} {r['update_us_p50']:8.1f} "
              f"{r['step_us_p50']:8.1f} {r['step_us_p90']:8.1f} {r['vs_fcfs_us_p50']:+8.1f} "
              f"{r['slot_preemptions']:6d} {r['budget_yields']:6d}")
    out = os.path.join(os.environ.get("OUT", "."), "bench_scheduler_policy.json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
