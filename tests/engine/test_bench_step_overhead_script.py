"""benchmarks/engine/bench_step_overhead.py on the CPU at its smallest: a greedy base variant and a sampled variant
with 8 adapters, the latter also as speculative verify steps (k = 2, overlapped scheduling), with cProfile's top
functions. Every phase is timed, "host" is the sum of the phases but "model", drafts are proposed only in the
verify rows, and the overlapped verify steps expose less than their host time."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_step_overhead")


def test_decode_and_verify_rows(capsys):
    threads = torch.get_num_threads()
    try:  # the script pins torch's threads and silences warnings for the process
        bench.main(["--batches", "2", "--variants", "greedy", "sampled+lora", "--vocab", "512", "--prompt-len", "8",
                    "--output-len", "4", "--steps", "3", "--spec", "2", "--async-scheduling", "--clock", "thread",
                    "--profile", "3"])
    finally:
        torch.set_num_threads(threads)
        logging.disable(logging.NOTSET)
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"{'batch':>5} {'variant':<18}"))
    assert lines[head].split()[2:] == list(bench.PHASES)
    rows = {}
    for line in lines[head + 1:]:
        if line[:5].strip() == "2":
            rows[line[6:24].strip()] = dict(zip(bench.PHASES, (float(v) for v in line[24:].split())))
    assert list(rows) == ["greedy", "greedy k=2", "sampled+lora", "sampled+lora k=2"]
    for name, r in rows.items():
        spec = name.endswith("k=2")
        for phase in ("schedule", "pack", "model", "sample", "runner", "update", "output", "deliver"):
            assert r[phase] > 0, (name, phase)
        assert (r["propose"] > 0) == spec, name
        # printed rounded to µs: the sum of eight rounded phases is within 4 µs of the printed host
        host = sum(v for k, v in r.items() if k not in ("model", "host", "exposed"))
        assert host == pytest.approx(r["host"], abs=5), name
        if spec:  # every counted verify step left the next one in flight: output and delivery overlap it
            assert r["exposed"] == pytest.approx(r["host"] - r["output"] - r["deliver"], abs=3), name
        else:
            assert r["exposed"] == r["host"], name
    # --profile 3: three functions per measured row, decode and verify steps
    titles = [line for line in lines if line.startswith("cProfile, 2 sequences")]
    assert [t.split(", ")[2].split(":")[0] for t in titles] == ["decode steps", "verify steps"] * 2
    for t in titles:
        i = lines.index(t)
        assert all(len(lines[j].split()) >= 4 and float(lines[j].split()[0]) >= 0 for j in range(i + 1, i + 4))
