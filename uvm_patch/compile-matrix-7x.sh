#!/bin/sh
# compile-matrix-7x.sh VERSION CELL [OUTDIR] [--no-stock] [--shim] [--ours-only]
#
# One Linux 7.x compile-matrix cell: uvm_patch/compile-matrix.sh run inside the Debian 13 (trixie) build
# root of tests/support/matrix7.py (gcc-14, as Debian's 7.x kernels are built; Debian's real
# linux-headers-<abi>-amd64 / -arm64 / -arm64-16k installed with apt; a 64 KiB-page arm64 tree prepared from
# Debian's linux-source of the same version). The root is built and cached on first use (root, network).
#
#   VERSION  NVIDIA driver version whose tree tests/support/nvsrc.py provides (Debian's, or exported from a
#            clone of NVIDIA/open-gpu-kernel-modules: python3 tests/support/nvsrc.py git-export CLONE TAG)
#   CELL     amd64 | arm64-4k | arm64-16k | arm64-64k
#   --no-stock  skip the stock build (STOCK=0);  --shim  OF_GPIO_SHIM=1;  --ours-only  OURS_ONLY=1
#   (conftests + uvm_mmu.o + uvm_pt_pack.o only; see compile-matrix.sh)
#
# Exit codes as compile-matrix.sh: 0 pass (or ours-compile), 1 fail, 3 stock-fails (NVIDIA's tree does not build there).
# Environment: SPARK_MEMSAVER_TEST_CACHE, JOBS, REPO (a checkout to bind at /repo instead of this one).
set -eu
[ $# -ge 2 ] || { sed -n '2,3p' "$0" >&2; exit 2; }
HERE=$(dirname "$(realpath "$0")")
VERSION=$1; CELL=$2; shift 2
OUT=/var/tmp/spark-memsaver-matrix/7x-$VERSION-$CELL
case "${1:-}" in ""|--*) ;; *) OUT=$1; shift ;; esac
exec python3 "$HERE/../tests/support/matrix7.py" cell "$VERSION" "$CELL" "$OUT" "$@"
