"""Grammar libraries for structured outputs, side by side on the engine's workload: llguidance and xgrammar.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_grammar.py                   # both vocabularies, batch 1/16/64
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_grammar.py --libs llguidance --vocabs 201088 --batches 16

For each library that imports (xgrammar is not a loraplex dependency: ``pip install --no-deps xgrammar==0.2.9
apache-tvm-ffi`` next to the CPU torch to include it) and each vocabulary (the tiny models' 320-id byte-level
BPE, and a synthetic 201,088-id byte-level BPE of GPT-OSS's size, ``grammar_vocab.py``):

    tokenizer_ms   wrapping the HF tokenizer for the library (once per engine)
    coverage       the JSON schemas of ``engine/structured/schema_suite.py``: compiled, and random constrained walks
                   (random allowed tokens, biased to close strings) parse with ``json.loads`` and validate with
                   ``jsonschema``; the unsupported ones: refused with an error naming the keyword, or accepted
                   (the keyword silently ignored)
    compile_ms     a new schema to a matcher ready for its first mask (median, max over the suite), and the
                   first mask, which both libraries compute lazily
    mask_us        per-token mask time at batch B: B matchers, each following a recorded valid walk of a suite
                   schema, one step = fill the packed int32 bitmask of all B rows (the library's parallel batch
                   call, and a plain loop over rows) + advance each by its token; µs per row per step, median
    fork_us / rollback_us   copying a mid-document matcher (n > 1), and undoing 4 tokens (speculative decoding)

Prints a table per vocabulary and writes ``$OUT/bench_grammar.json``. CPU only; numbers are host time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from loraplex.engine.structured.schema_suite import SCHEMAS, UNSUPPORTED  # noqa: E402

STRUCTURAL = b'"}],'


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.version = llguidance.__version__ if hasattr(llguidance, "__version__") else _dist_version("llguidance")

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        v = mask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, ms, mask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], mask.data_ptr(),
                                              mask.shape[1] * 4, mask.shape[0])

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def fork(self, m):
        return m.deep_copy()

    def rollback(self, m, k: int) -> None:
        m.rollback(k)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab_size: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.version = _dist_version("xgrammar")

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, ms, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def fork(self, m):
        return m.fork()

    def rollback(self, m, k: int) -> None:
        m.rollback(k)


LIBS = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _allowed(mask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(lib, compiled, token_bytes: list[bytes], structural: np.ndarray, vocab: int, eos: int, seed: int,
         max_tokens: int = 160) -> list[int]:
    """A random valid document: random allowed tokens, half the time one holding a quote / bracket / comma."""
    rng = random.Random(seed)
    m = lib.matcher(compiled)
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    tokens: list[int] = []
    while len(tokens) < max_tokens and not lib.done(m):
        lib.fill(m, mask, 0)
        allowed = _allowed(mask[0], vocab)
        if eos in allowed:
            break
        pick = allowed[structural[allowed]] if rng.random() < 0.5 else allowed
        token = int(rng.choice(list(pick if len(pick) else allowed)))
        if not lib.consume(m, token):
            raise RuntimeError(f"{lib.name} refused a token of its own mask")
        tokens.append(token)
    return tokens


def coverage(lib, hf_tok, token_bytes, structural, vocab, eos) -> tuple[dict, dict]:
    import jsonschema

    rows, walks = {}, {}
    for name, schema in SCHEMAS.items():
        try:
            compiled = lib.compile(schema)
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows[name] = f"compile error: {str(e)[:80]}"
            continue
        valid = 0
        for seed in range(3):
            tokens = walk(lib, compiled, token_bytes, structural, vocab, eos, seed)
            try:
                jsonschema.validate(json.loads(hf_tok.decode(tokens)), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
            walks.setdefault(name, tokens)
        rows[name] = f"{valid}/3 valid"
    for name, (schema, keyword) in UNSUPPORTED.items():
        try:
            lib.compile(schema)
            rows[f"unsupported:{name}"] = "accepted (keyword ignored)"
        except Exception as e:  # noqa: BLE001
            rows[f"unsupported:{name}"] = "refused, names it" if keyword in str(e) else f"refused: {str(e)[:60]}"
    return rows, walks


def compile_times(lib, vocab: int) -> dict:
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    comp, first = [], []
    for salt, schema in enumerate(SCHEMAS.values()):
        schema = dict(schema, title=f"fresh-{salt}-{time.perf_counter_ns()}")  # a schema no cache has seen
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        m = lib.matcher(compiled)
        t1 = time.perf_counter()
        lib.fill(m, mask, 0)
        t2 = time.perf_counter()
        comp.append((t1 - t0) * 1e3)
        first.append((t2 - t1) * 1e3)
    return {"compile_ms_median": statistics.median(comp), "compile_ms_max": max(comp),
            "first_mask_ms_median": statistics.median(first), "first_mask_ms_max": max(first)}


def mask_times(lib, compiled: dict, walks: dict, vocab: int, batch: int, steps: int) -> dict:
    names = [n for n in walks if walks[n]]
    mask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    rows = [[names[i % len(names)], lib.matcher(compiled[names[i % len(names)]]), i % 7] for i in range(batch)]
    for r in rows:  # stagger the rows along their documents
        for t in walks[r[0]][:r[2]]:
            lib.consume(r[1], t)
    par, loop, adv = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        lib.fill_batch([r[1] for r in rows], mask)
        t1 = time.perf_counter()
        for i, r in enumerate(rows):
            lib.fill(r[1], mask, i)
        t2 = time.perf_counter()
        for r in rows:
            name, m, pos = r
            if pos >= len(walks[name]) or lib.done(m):
                r[1], r[2] = lib.matcher(compiled[name]), 0
                continue
            lib.consume(m, walks[name][pos])
            r[2] = pos + 1
        t3 = time.perf_counter()
        if step >= 2:  # warm-up: lazily built lexer states
            par.append((t1 - t0) / batch * 1e6)
            loop.append((t2 - t1) / batch * 1e6)
            adv.append((t3 - t2) / batch * 1e6)
    return {"mask_us_per_row_batch_call": statistics.median(par), "mask_us_per_row_loop": statistics.median(loop),
            "advance_us_per_row": statistics.median(adv)}


def fork_rollback(lib, compiled: dict, walks: dict, vocab: int) -> dict:
    mask_a = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    mask_b = mask_a.clone()
    forks, rolls, ok = [], [], True
    for name, tokens in walks.items():
        if len(tokens) < 10:
            continue
        m = lib.matcher(compiled[name])
        for t in tokens[:-5]:
            lib.consume(m, t)
        t0 = time.perf_counter()
        child = lib.fork(m)
        forks.append((time.perf_counter() - t0) * 1e6)
        lib.fill(m, mask_a, 0)
        for t in tokens[-5:-1]:
            lib.consume(child, t)
        t0 = time.perf_counter()
        lib.rollback(child, 4)
        rolls.append((time.perf_counter() - t0) * 1e6)
        lib.fill(child, mask_b, 0)
        ok = ok and torch.equal(mask_a, mask_b)
    return {"fork_us_median": statistics.median(forks), "rollback4_us_median": statistics.median(rolls),
            "rollback_restores_mask": ok}


def run_vocab(lib_names: list[str], vocab: int, batches: list[int], steps: int) -> dict:
    if vocab <= 1024:
        from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer

        hf_tok = build_tiny_tokenizer(vocab)
    else:
        from grammar_vocab import synthetic_bpe_tokenizer

        hf_tok = synthetic_bpe_tokenizer(vocab)
    eos = hf_tok.eos_token_id
    token_bytes = [b""] * vocab
    for text, i in hf_tok.get_vocab().items():
        token_bytes[i] = hf_tok.convert_tokens_to_string([text]).encode("utf-8", "replace")
    structural = np.array([any(c in b for c in STRUCTURAL) for b in token_bytes])
    results = {}
    for name in lib_names:
        try:
            t0 = time.perf_counter()
            lib = LIBS[name](hf_tok, vocab, eos)
            tok_ms = (time.perf_counter() - t0) * 1e3
        except ImportError as e:
            results[name] = {"error": f"not installed: {e}"}
            continue
        cov, walks = coverage(lib, hf_tok, token_bytes, structural, vocab, eos)
        compiled = {n: lib.compile(SCHEMAS[n]) for n in walks}
        res = {"version": lib.version, "tokenizer_ms": tok_ms, "coverage": cov, **compile_times(lib, vocab),
               **fork_rollback(lib, compiled, walks, vocab)}
        for b in batches:
            res[f"batch_{b}"] = mask_times(lib, compiled, walks, vocab, b, steps)
        results[name] = res
    return results


def to_table(vocab: int, results: dict, batches: list[int]) -> str:
    libs = [n for n in results if "error" not in results[n]]
    lines = [f"vocabulary {vocab}", "| metric | " + " | ".join(f"{n} {results[n]['version']}" for n in libs) + " |",
             "|---|" + "---|" * len(libs)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(results[n]) for n in libs) + " |")

    n_schemas = len(SCHEMAS)
    row("suite schemas valid (3 walks each)",
        lambda r: f"{sum(v == '3/3 valid' for k, v in r['coverage'].items() if ':' not in k)}/{n_schemas}")
    row("unsupported keywords refused by name",
        lambda r: f"{sum(v == 'refused, names it' for k, v in r['coverage'].items() if ':' in k)}/{len(UNSUPPORTED)}")
    row("tokenizer setup ms", lambda r: f"{r['tokenizer_ms']:.0f}")
    row("compile ms (median / max)", lambda r: f"{r['compile_ms_median']:.2f} / {r['compile_ms_max']:.2f}")
    row("first mask ms (median / max)", lambda r: f"{r['first_mask_ms_median']:.2f} / {r['first_mask_ms_max']:.2f}")
    for b in batches:
        row(f"mask µs/row, batch {b} (batch call / loop)",
            lambda r, b=b: f"{r[f'batch_{b}']['mask_us_per_row_batch_call']:.1f} / "
                           f"{r[f'batch_{b}']['mask_us_per_row_loop']:.1f}")
        row(f"advance µs/row, batch {b}", lambda r, b=b: f"{r[f'batch_{b}']['advance_us_per_row']:.1f}")
    row("fork µs", lambda r: f"{r['fork_us_median']:.1f}")
    row("rollback(4) µs, mask restored", lambda r: f"{r['rollback4_us_median']:.1f}, {r['rollback_restores_mask']}")
    bad = {n: {k: v for k, v in results[n]["coverage"].items() if v not in ("3/3 valid", "refused, names it")}
           for n in libs}
    lines.append("not clean: " + json.dumps(bad))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    ap.add_argument("--vocabs", nargs="+", type=int, default=[320, 201088])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0], "vocabs": {}}
    for vocab in args.vocabs:
        report["vocabs"][str(vocab)] = run_vocab(args.libs, vocab, args.batches, args.steps)
        print(to_table(vocab, report["vocabs"][str(vocab)], args.batches), flush=True)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_grammar.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
