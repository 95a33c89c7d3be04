#!/usr/bin/env python3
"""compile-matrix-rows.py OUTDIR... : one COMPILE-MATRIX.md table row per compile-matrix.sh result.json.

Columns: driver | kernel | arch | page | result | errors stock / patched | our objects | warnings ours (W=1) |
new undefined | build s (stock / patched) | compiler | pool sha256[:16] | shims
"""
import json
import sys
from pathlib import Path

PAGE = {4096: "4K", 16384: "16K", 65536: "64K"}


def row(d: dict) -> str:
    st = d["status"]
    if st == "stock-fails":
        result = f"**stock tree fails**: `{d['stock_error']}` (patched: identical error set)"
    elif st == "ours-compile":
        result = "**our objects compile** (uvm_mmu.o + uvm_pt_pack.o; no module build)"
    else:
        result = f"**{st}**" + (f": {'; '.join(d['failures'])}" if d["failures"] else "")
    errs = "–" if d.get("ours_only") else f"{d.get('errors_stock', 0)} / {d.get('errors_patched', 0)}"
    und = d.get("undefined_new")
    und = "–" if und is None or (st == "stock-fails" and not Path(d.get("_dir", "")).joinpath(
        "stock.mmu.undefined").exists()) or st == "ours-compile" else str(len(und))
    w1 = "–" if d.get("w1_warnings_ours") is None else f"{d['w1_warnings_ours']} (of {d['w1_warnings_total']})"
    secs = f"{d['stock_seconds'] if d['stock_seconds'] is not None else '–'} / {d['patched_seconds']}"
    cc = d.get("cc_used", "").replace("(Debian ", "").replace(")", "").strip()
    return (f"| {d['version']} | {d['kernel']} | {d['arch']} | {PAGE.get(d.get('page_size'), '?')} | {result} | "
            f"{errs} | {' '.join(d.get('ours_built', [])) or 'none'} | {w1} | {und} | {secs} | {cc} | "
            f"{d.get('pool_sha256_16', '')} | {' '.join(d.get('shims', [])) or '–'} |")


def main(argv):
    for a in argv:
        p = Path(a)
        p = p / "result.json" if p.is_dir() else p
        d = json.loads(p.read_text())
        d["_dir"] = str(p.parent)
        print(row(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
