"""benchmarks/kernels/sm90_loops.py on the CPU: the MXFP4 GEMMs at the H200's tuned M = 16 config build for sm_90 with
the installed Triton, the script finds their K loops, and the loops hold what the tile says (the MMAs of the
tile, the words in 16-byte loads, no decoded tile in shared memory); an unknown case group is refused. Run in a
child process: this session's kernels are interpreted."""
import json
import os
import subprocess
import sys
from pathlib import Path

from loraplex.kernels import fused_moe_mxfp4 as fm
from loraplex.kernels import tuning

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "sm90_loops.py"
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_mxfp4_gemm_loops_hold_the_tiles_mmas_and_no_shared_memory_tile(tmp_path):
    out = tmp_path / "loops.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4", "--m", "16", "--json", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["fused_moe_mxfp4 down M=16", "fused_moe_mxfp4 gate_up M=16"]
    cfg = tuning.get_config("fused_moe_mxfp4", {"E": 32, "A": 4, "H": 2880, "I": 2880}, 16, fm.DEFAULT_CONFIG,
                            device_name="NVIDIA H200")
    bm, bn, bk, warps = (int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"))
    assert bm == 8 and not int(cfg.get("GU_FUSED", 0)), "the expected MMA counts below are for mma.sync m16n8k16"
    per_matrix = (bn // 16 // warps) * (bk // 16)  # m16n8k16 MMAs per warp and K step: row tiles x K steps
    for case, matrices in (("gate_up", 2), ("down", 1)):
        row = rows[f"fused_moe_mxfp4 {case} M=16"]
        assert row["mma"] == matrices * per_matrix, row
        assert row["ldg128"] > 0 and row["sts"] <= 2, row  # no [BLOCK_N, BLOCK_K] tile stored (it would be 32+)
        assert 10 < row["per_word"] < 40 and row["loop"] > row["mma"], row
        assert row["regs"] > 0 and row["triton"]


def test_unknown_case_group_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4,tensor_cores"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown case group(s) tensor_cores" in proc.stderr
