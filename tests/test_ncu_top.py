"""bench/ncu_top.py: the stall hot spots of an ncu source export (read on CPU from a written CSV)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.ncu_top import main, top_lines  # noqa: E402

CSV = ('==PROF== a preamble line ncu prints\n'
       '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
       '"0x00","MOV R1, c[0x0][0x28]","2","1"\n"0x10","LDG.E.64 R2, [R4.64]","50","40"\n'
       '"0x20","IMAD R6, R2, R3, RZ","0","0"\n"0x30","BAR.SYNC.DEFER_BLOCKING 0x0","30","30"\n')


def test_top_lines_in_program_order_with_shares(tmp_path):
    f = tmp_path / "src.csv"
    f.write_text(CSV)
    res = top_lines(str(f), 2)
    assert res["total"] == 82
    assert [(i, v) for i, v, _, _ in res["lines"]] == [(1, 50.0), (3, 30.0)]  # the two largest, in program order
    assert res["lines"][0][3].startswith("LDG") and abs(res["lines"][1][2] - 30 / 82) < 1e-12
    out = tmp_path / "top.json"
    assert main([str(f), "--top", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["lines"][0][1] == 50.0


def test_a_file_without_the_samples_column_is_refused(tmp_path):
    f = tmp_path / "details.txt"
    f.write_text('"Section","Metric","Value"\n"Launch","Grid Size","8"\n')
    with pytest.raises(ValueError, match="not an ncu --page source --csv export"):
        top_lines(str(f), 5)
