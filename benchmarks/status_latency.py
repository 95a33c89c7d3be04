#!/usr/bin/env python3
"""Time `spark-memsaver status --json` on this host: median (and spread) of N runs, whole process.

Usage: benchmarks/status_latency.py [--runs N] [--root DIR]
Prints one line per figure and, last, `status_median_ms=<x> in_process_median_ms=<y>`.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--root", default="/")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    argv = ["/usr/bin/python3", "-m", "spark_memsaver", "--root", a.root, "status", "--json", "--direct"]
    subprocess.run(argv, env=env, capture_output=True)  # warm the page cache
    wall = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=env, capture_output=True)
        wall.append((time.perf_counter() - t0) * 1000)
        if r.returncode not in (0, 1):
            sys.exit(f"status failed: rc={r.returncode} {r.stderr.decode()[-300:]}")
    sys.path.insert(0, str(REPO / "daemon"))
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host
    from spark_memsaver.report.document import status
    inproc = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        status(Host(a.root), Config())
        inproc.append((time.perf_counter() - t0) * 1000)
    print(f"runs: {a.runs}  root: {a.root}")
    print(f"whole process (python start + inspect + JSON): median {statistics.median(wall):.1f} ms, "
          f"min {min(wall):.1f}, max {max(wall):.1f}")
    print(f"in-process snapshot + evaluate + document:    median {statistics.median(inproc):.1f} ms, "
          f"min {min(inproc):.1f}, max {max(inproc):.1f}")
    print(f"budget 500 ms; ratio {statistics.median(wall) / 500:.2f}")
    print(f"status_median_ms={statistics.median(wall):.1f} in_process_median_ms={statistics.median(inproc):.1f}")


if __name__ == "__main__":
    main()
