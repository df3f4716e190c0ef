"""benchmarks/kernels/sm90_loops.py on the CPU: the MXFP4 GEMMs at a fixed M = 16 config build for sm_90 with
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


# the config the test builds (the script reads it as the H200's tuned M = 16 entry): mma.sync m16n8k16 at 4 warps
CONFIG = {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "GU_SPLIT_K": 1, "GU_FUSED": 0,
          "PREFETCH": 1, "PDL": 0, "DECODE": "asm", "DIRECT": 0, "num_warps": 4, "num_stages": 1}


def _env(tuning_root=None) -> dict:
    """This environment without the interpreter; tuning files from ``tuning_root`` (default: the repository's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tuning.TUNING_DIR_ENV)}
    return env if tuning_root is None else {**env, tuning.TUNING_DIR_ENV: str(tuning_root)}


def test_mxfp4_gemm_loops_hold_the_tiles_mmas_and_no_shared_memory_tile(tmp_path):
    tuning.write_configs("fused_moe_mxfp4", {"E=32,A=4,H=2880,I=2880": {16: CONFIG}}, device_name="NVIDIA H200",
                         root=tmp_path / "configs")
    out = tmp_path / "loops.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4", "--m", "16", "--json", str(out)],
                          cwd=ROOT, env=_env(tmp_path / "configs"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["fused_moe_mxfp4 down M=16", "fused_moe_mxfp4 gate_up M=16"]
    for case, matrices in (("gate_up", 2), ("down", 1)):
        row = rows[f"fused_moe_mxfp4 {case} M=16"]
        c = row["constexprs"]
        assert (c["BLOCK_M"], c["BLOCK_N"], c["PREFETCH"], row["num_warps"]) == (8, 64, 1, 4), row  # CONFIG read
        # m16n8k16 MMAs per warp and K step: its 16-row tiles x the K step's 16-deep slices, per weight matrix
        assert row["mma"] == matrices * (64 // 16 // 4) * (128 // 16), row
        assert row["ldg128"] > 0 and row["sts"] <= 2, row  # no [BLOCK_N, BLOCK_K] tile stored (it would be 32+)
        assert 10 < row["per_word"] < 40 and row["loop"] > row["mma"], row
        assert row["regs"] > 0 and row["triton"]


def test_unknown_case_group_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "mxfp4,tensor_cores"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown case group(s) tensor_cores" in proc.stderr
