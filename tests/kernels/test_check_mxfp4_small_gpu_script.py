"""benchmarks/kernels/check_mxfp4_small_gpu.py's CPU smoke run (``--device cpu``, the interpreter) at its first small
shape (E=6, A=2, H=64, I=32; the other CPU shapes take ~3x longer): both layouts' fused_moe_mxfp4 and
moe_experts_lora at M = 1, 5, 33 pass the float32 bound; a kernel that raises is a failed case, not a crash."""
from __future__ import annotations

import re

from tests.utils.scripts import load_script

LINE = re.compile(r"^(PASS|FAIL) E=6 A=2 H=64 I=32 M=(\d+) float32 eager (.+): rel err (\S+) \(bound (\S+)\)$")


def test_first_small_shape_on_the_cpu(monkeypatch, capsys):
    check = load_script("kernels", "check_mxfp4_small_gpu")
    # the CPU run leaves out the last (GPT-OSS) shape: keep the first small one only
    monkeypatch.setattr(check, "SHAPES", (check.SHAPES[0], check.SHAPES[-1]))
    assert check.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "check: PASS"
    rows = [LINE.match(line).groups() for line in lines[:-1]]
    names = ("fused_moe_mxfp4 kernel layout", "fused_moe_mxfp4 checkpoint layout", "moe_experts_lora kernel layout",
             "moe_experts_lora checkpoint layout")
    assert [(int(m), name) for _, m, name, _, _ in rows] == [(m, n) for m in (1, 5, 33) for n in names]
    for verdict, _, _, err, bound in rows:
        assert float(bound) == 1e-4 and 0 < float(err) <= float(bound) and verdict == "PASS"


def test_a_crashing_kernel_is_a_failed_case(monkeypatch):
    from loraplex.kernels import fused_moe_mxfp4

    check = load_script("kernels", "check_mxfp4_small_gpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(fused_moe_mxfp4, "fused_moe_mxfp4", broken)
    lines = dict((line.split(": ")[0].split(" eager ")[1], (line, ok)) for line, ok in
                 check.case(6, 2, 64, 32, 1, check.torch.float32, False, "cpu"))
    for name in ("fused_moe_mxfp4 kernel layout", "fused_moe_mxfp4 checkpoint layout"):
        line, ok = lines[name]
        assert not ok and line.startswith("FAIL") and line.endswith("RuntimeError: no kernel today")
    assert all(ok for name, (_, ok) in lines.items() if name.startswith("moe_experts_lora"))
