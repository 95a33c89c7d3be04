#!/usr/bin/env python3
"""Time `spark-memsaver status --json --direct` as a whole process, beside a bare `python3 -c pass` measured in
the same run (interleaved, so a loaded machine slows both alike), on this host and on a Spark-shaped root.

Usage: benchmarks/status_latency.py [--runs N] [--root DIR] [--no-spark] [--keep-spark DIR] [--instructions]

- The checkout's bytecode is compiled first (an installed package has it; PYTHONDONTWRITEBYTECODE may be set).
- Spark-shaped root: tests/support/sparkroot.py's GB10 layout (kernel 6.14 64k, NVIDIA 580.142 loaded, real
  ELF modules, depmod), with NVIDIA's real 580.142 kernel-open tree in /usr/src/nvidia-580.142
  (tests/support/nvsrc.py) and this host's real APT state (/etc/apt, /var/lib/apt/lists, dpkg's status).
  A second variant without the source tree makes status look the source up in those APT lists (memoised in
  the root's /var/cache/spark-memsaver, which the package creates, by the lists' and dpkg's mtimes).
- The product's data files (manifest, hazards table) are parsed once per version and kept in
  /var/cache/spark-memsaver/parsed on an installed node (spark_memsaver/yamlio.py); a checkout without that
  directory parses them every time. One more row runs status with such a parsed copy (in a temporary directory).
- Figures per command: median wall ms, min, and median CPU ms (user+sys of the child: less load-sensitive),
  each also as a ratio to the bare interpreter's.
- ``--instructions``: each command once more under valgrind's callgrind (children too: a modinfo status runs
  counts), its instructions executed (Ir) beside the bare interpreter's: unlike times, the same on a loaded
  machine, but blind to what costs time without instructions (exec, page faults, dynamic loading, I/O).
Last line, exactly: ``status_median_ms=<x> bare_median_ms=<b> ratio=<x/b> spark_median_ms=<y> spark_ratio=<y/b>``.
Goals (issue 25): status <= 80 ms median and <= 4x bare python, on both roots.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = "/usr/bin/python3"


def spark_root(dest: Path, with_source: bool = True) -> Path:
    """A Spark-shaped root with NVIDIA's real source tree and this host's APT lists (see the docstring)."""
    sys.path.insert(0, str(REPO))
    from tests.support import nvsrc, sparkroot

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    sparkroot.make_spark_root(dest)
    (dest / "var/cache/spark-memsaver").mkdir(parents=True)     # the package's (tmpfiles.d, CacheDirectory=)
    src = dest / f"usr/src/nvidia-{sparkroot.DRIVER}"
    shutil.rmtree(src)
    if with_source:
        shutil.copytree(nvsrc.nvidia_source(sparkroot.DRIVER), src, symlinks=True)
    for d in ("etc/apt", "var/lib/apt/lists"):
        if Path("/", d).is_dir():
            shutil.copytree(Path("/", d), dest / d, symlinks=True, ignore=shutil.ignore_patterns("lock", "partial"))
    if Path("/var/lib/dpkg/status").is_file():
        (dest / "var/lib/dpkg").mkdir(parents=True, exist_ok=True)
        shutil.copy("/var/lib/dpkg/status", dest / "var/lib/dpkg/status")
    return dest


def run_once(argv, env) -> tuple[float, float, int, str]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = (time.perf_counter() - t0) * 1000
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1000
    return wall, cpu, r.returncode, r.stderr


def instructions(argv, env, work: Path) -> int:
    """Instructions executed by ``argv`` and every process it runs (callgrind's totals, summed)."""
    out = Path(tempfile.mkdtemp(prefix="callgrind.", dir=work))
    r = subprocess.run(["valgrind", "--tool=callgrind", "--trace-children=yes",
                        f"--callgrind-out-file={out}/cg.%p", *argv], env=dict(env, PYTHONHASHSEED="0"),
                       capture_output=True, text=True)
    if r.returncode not in (0, 1):
        sys.exit(f"valgrind {argv}: rc={r.returncode} {r.stderr[-300:]}")
    total = 0
    for f in out.iterdir():
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total += int(line.split()[1])
                break
    shutil.rmtree(out, ignore_errors=True)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--root", default="/", help="the first root (default: this host)")
    ap.add_argument("--no-spark", action="store_true", help="only the first root")
    ap.add_argument("--keep-spark", default=None, help="build the Spark-shaped roots here and keep them")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each command's instructions once under valgrind --tool=callgrind")
    a = ap.parse_args()
    if a.instructions and shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (tools/deps/dbus.txt)")

    subprocess.run([PY, "-m", "compileall", "-q", str(REPO / "daemon")], check=True)
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    status = [PY, "-m", "spark_memsaver", "--root", "{root}", "status", "--json", "--direct"]
    cmds = {"bare python3 -c pass": [PY, "-c", "pass"],
            f"status --json ({a.root})": [x.replace("{root}", a.root) for x in status]}
    work = None
    if not a.no_spark:
        work = Path(a.keep_spark) if a.keep_spark else Path(tempfile.mkdtemp(prefix="status-latency."))
        t = time.monotonic()
        spark = spark_root(work / "spark")
        nosrc = spark_root(work / "spark-nosrc", with_source=False)
        print(f"Spark-shaped roots built in {time.monotonic() - t:.1f} s: {spark} (source tree + APT lists), "
              f"{nosrc} (APT lists, no source tree)")
        cmds["status --json (Spark root)"] = [x.replace("{root}", str(spark)) for x in status]
        cmds["status --json (Spark root, no source)"] = [x.replace("{root}", str(nosrc)) for x in status]
        wrapper = ("import sys; from spark_memsaver import yamlio; yamlio.DATA_CACHE = sys.argv[1]; "
                   "sys.argv = ['spark-memsaver', *sys.argv[2:]]; from spark_memsaver.cli.entry import main; main()")
        cmds["status --json (Spark root, data parsed)"] = [PY, "-c", wrapper, str(work / "parsed")] + [
            x.replace("{root}", str(spark)) for x in status[3:]]
        cmds["status -q (Spark root, data parsed)"] = [PY, "-c", wrapper, str(work / "parsed"), "--root", str(spark),
                                                       "status", "-q", "--direct"]
    try:
        for argv in cmds.values():           # warm the page cache (and the APT memo, where it may be written)
            run_once(argv, env)
        figures = {k: ([], []) for k in cmds}
        for _ in range(a.runs):
            for k, argv in cmds.items():
                wall, cpu, rc, err = run_once(argv, env)
                if rc not in (0, 1):
                    sys.exit(f"{k} failed: rc={rc} {err[-300:]}")
                figures[k][0].append(wall)
                figures[k][1].append(cpu)
        ir = {k: instructions(argv, env, work or Path(tempfile.gettempdir())) for k, argv in cmds.items()} \
            if a.instructions else {}
    finally:
        if work is not None and not a.keep_spark:
            shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"runs: {a.runs} each, interleaved; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{os.cpu_count()} CPUs; {sys.version.split()[0]} ({PY})")
    med = {k: (statistics.median(w), statistics.median(c), min(w)) for k, (w, c) in figures.items()}
    bare_w, bare_c, _ = med["bare python3 -c pass"]
    for k, (w, c, mn) in med.items():
        print(f"{k:40s} median {w:7.1f} ms (x{w / bare_w:5.2f})  min {mn:7.1f} ms  cpu {c:7.1f} ms "
              f"(x{c / bare_c:5.2f})")
    if ir:
        bare_ir = ir["bare python3 -c pass"]
        for k, n in ir.items():
            print(f"{k:40s} instructions {n / 1e6:8.1f} M (x{n / bare_ir:5.2f})")
    host = med[f"status --json ({a.root})"][0]
    line = f"status_median_ms={host:.1f} bare_median_ms={bare_w:.1f} ratio={host / bare_w:.2f}"
    if "status --json (Spark root)" in med:
        sp = med["status --json (Spark root)"][0]
        line += f" spark_median_ms={sp:.1f} spark_ratio={sp / bare_w:.2f}"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
