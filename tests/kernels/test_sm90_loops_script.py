"""benchmarks/kernels/sm90_loops.py on the CPU: the MXFP4 GEMMs at the H200's tuned M = 16 config build for sm_90 with
the installed Triton, the script finds their K loops, and the loops hold what the tile says (the MMAs of the
tile, the words in 16-byte loads, no decoded tile in shared memory); an unknown case group is refused. Run in a
child process: this session's kernels are interpreted."""
import json
import os
import subprocess
import sys
from pathlib import Path

from loraplex.kernels import tuning

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "sm90_loops.py"


def _env() -> dict:
    """This environment without the interpreter, reading the repository's tuning files."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tuning.TUNING_DIR_ENV)}


def test_mxfp4_gemm_loops_hold_the_tiles_mmas_and_no_shared_memory_tile(tmp_path):
    out = tmp_path / "loops.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4", "--m", "16", "--json", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["fused_moe_mxfp4 down M=16", "fused_moe_mxfp4 gate_up M=16"]
    for case, matrices in (("gate_up", 2), ("down", 1)):
        row = rows[f"fused_moe_mxfp4 {case} M=16"]
        c, warps = row["constexprs"], row["num_warps"]
        assert c["BLOCK_M"] == 8 and not c.get("FUSED"), "the H200's M = 16 config: mma.sync m16n8k16, 4 warps"
        # m16n8k16 MMAs per warp and K step: its 16-row tiles x the K step's 16-deep slices, per weight matrix
        assert row["mma"] == matrices * (c["BLOCK_N"] // 16 // warps) * (c["BLOCK_K"] // 16), row
        assert row["ldg128"] > 0 and row["sts"] <= 2, row  # no [BLOCK_N, BLOCK_K] tile stored (it would be 32+)
        assert 10 < row["per_word"] < 40 and row["loop"] > row["mma"], row
        assert row["regs"] > 0 and row["triton"]


def test_unknown_case_group_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4,tensor_cores"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown case group(s) tensor_cores" in proc.stderr
