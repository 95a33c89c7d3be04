#!/bin/bash
# compile-matrix.sh SRC KERNEL_BUILD_DIR ARCH [OUTDIR]
#
# Compile-verify the spark-memsaver hooks for one NVIDIA tree, one kernel, one architecture:
#   1. stock build: a copy of SRC, nvidia-uvm.ko built with NVIDIA's Makefile (unless STOCK=0);
#   2. patched build: SRC -> OUTDIR/patched through the apply step
#      (python3 -m spark_memsaver patch apply), then the same build;
#   3. checks: the patched build adds no compiler warning (set of normalised warnings, patched minus
#      stock; with STOCK=0: no warning in uvm_pt_pack.[ch] or in uvm_mmu.[ch] lines we touched), no new
#      undefined symbol (beyond nvidia.ko's nvUvmInterface* exports), and the .ko carries
#      parm uvm_pt_pack + uvm_pt_pack_stats, spark_memsaver=uvm-pt-pack/1, version=<driver version>,
#      the right ELF machine and vermagic.
#
# SRC: NVIDIA tree in /usr/src layout (= upstream kernel-open/). KERNEL_BUILD_DIR: a prepared kernel
# build tree (/lib/modules/<rel>/build, or tests/support/nvsrc.py's arm64 64K tree). ARCH: x86_64|arm64.
#
# COMPILE-ONLY: nvidia-uvm alone needs the conftests that only nvidia.Kbuild registers, so a
# conftest-only pseudo-module "nvconftest" (NV_CONFTEST_* lines of nvidia/nvidia.Kbuild, no obj-m) is
# added to NV_KERNEL_MODULES; and modpost runs with KBUILD_MODPOST_WARN=1 because nvidia.ko's
# Module.symvers (the nvUvmInterface* CRCs) is not built here. Such a module has no nvUvm CRCs and
# MUST NOT be deployed: it proves compilation only. The DKMS build uses KBUILD_EXTRA_SYMBOLS instead.
#
# Environment: JOBS (default 2), STOCK=0 to skip the stock build, PYTHON (default /usr/bin/python3).
# Output: OUTDIR/{stock,patched}.log, OUTDIR/result.json, one summary line on stdout. Exit 0 = pass.
set -euo pipefail

usage() { sed -n '2,3p' "$0" >&2; exit 2; }
[ $# -ge 3 ] || usage
SRC=$(realpath "$1"); KDIR=$(realpath "$2"); ARCH=$3
HERE=$(dirname "$(realpath "$0")"); REPO=$(dirname "$HERE")
JOBS=${JOBS:-2}; STOCK=${STOCK:-1}; PYTHON=${PYTHON:-/usr/bin/python3}

VERSION=$(sed -n 's/.*-DNV_VERSION_STRING=\\"\([^\\"]*\)\\".*/\1/p' "$SRC/Kbuild" | head -1)
[ -n "$VERSION" ] || { echo "cannot read NV_VERSION_STRING from $SRC/Kbuild" >&2; exit 2; }
OUT=$(realpath -m "${4:-/var/tmp/spark-memsaver-matrix/$VERSION-$ARCH}")

case "$ARCH" in
  x86_64) CROSS=""; MACHINE="X86-64";  MAKEARCH=(ARCH=x86_64) ;;
  # NVIDIA's Makefile passes "LD=$(LD)" down (default plain ld) in 575+: name the cross tools explicitly.
  arm64)  CROSS=aarch64-linux-gnu-; MACHINE="AArch64"
          MAKEARCH=(ARCH=arm64 CROSS_COMPILE=$CROSS CC=${CROSS}gcc LD=${CROSS}ld OBJDUMP=${CROSS}objdump) ;;
  *) echo "ARCH must be x86_64 or arm64" >&2; exit 2 ;;
esac
# Debian splits headers into a build (output) tree whose Makefile includes the source (common) tree.
SYSOUT=$KDIR
SYSSRC=$(sed -n 's#^include \(/.*\)/Makefile$#\1#p' "$KDIR/Makefile" | head -1)
[ -n "$SYSSRC" ] && [ -d "$SYSSRC" ] || SYSSRC=$KDIR
KREL=$(sed -n 's/^#define UTS_RELEASE "\(.*\)"$/\1/p' "$SYSOUT/include/generated/utsrelease.h")

rm -rf "$OUT"; mkdir -p "$OUT"
exec 3>&1
log() { echo "[$(date -u +%H:%M:%S)] $*" >&3; }

add_nvconftest() {  # $1 tree: conftest lists borrowed from nvidia.Kbuild, no obj-m
  mkdir -p "$1/nvconftest"
  { echo "# compile-matrix: conftest lists of nvidia.Kbuild only (no module)"
    grep -E '^NV_CONFTEST' "$1/nvidia/nvidia.Kbuild"; } > "$1/nvconftest/nvconftest.Kbuild"
}

build() {  # $1 tree, $2 name -> $OUT/$2.log, $OUT/$2.seconds, rc
  local t0 rc=0
  t0=$(date +%s)
  ( cd "$1" && env KBUILD_MODPOST_WARN=1 nice -n 5 make -j"$JOBS" "${MAKEARCH[@]}" \
        SYSSRC="$SYSSRC" SYSOUT="$SYSOUT" NV_KERNEL_MODULES="nvconftest nvidia-uvm" modules ) \
        > "$OUT/$2.log" 2>&1 || rc=$?
  echo $(( $(date +%s) - t0 )) > "$OUT/$2.seconds"
  return $rc
}

warnings() {  # $1 log, $2 tree -> normalised "file: warning: text" lines (no line numbers), sorted
  grep -E '(warning|error): ' "$1" | grep -v '^WARNING: modpost' \
    | sed -e "s#$2/##g" -e 's#^\([^:]*\):[0-9]*:[0-9]*:#\1:#' | sort -u || true
}

undefined() {  # $1 .ko -> undefined symbols not exported by the kernel and not nvUvmInterface*
  comm -23 <(${CROSS}nm -u "$1" | awk '{print $2}' | sort -u) \
           <(awk '{print $2}' "$SYSOUT/Module.symvers" | sort -u) | grep -v '^nvUvmInterface' || true
}

modinfo_f() {  # $1 key, $2 .ko: like modinfo -F, for any architecture (reads .modinfo with readelf)
  readelf -p .modinfo "$2" | sed -n "s/^ *\[ *[0-9a-f]*\] *$1=//p"
}

undefined_ours() {  # $1 tree, $2 .ko -> symbols our objects need that neither the kernel exports, nor the
  # module defines, nor any stock NVIDIA object of the same build also needs (config artefacts of the tree)
  local t=$1
  comm -23 <(${CROSS}nm -u "$t/nvidia-uvm/uvm_pt_pack.o" "$t/nvidia-uvm/uvm_mmu.o" | awk 'NF==2 {print $2}' | sort -u) \
    <( { awk '{print $2}' "$SYSOUT/Module.symvers"
         ${CROSS}nm --defined-only "$2" | awk '{print $3}'
         find "$t/nvidia-uvm" -name '*.o' ! -name uvm_pt_pack.o ! -name uvm_mmu.o -print0 \
           | xargs -0 ${CROSS}nm -u | awk 'NF==2 {print $2}'; } | sort -u ) || true
}

STOCK_S=null
if [ "$STOCK" = 1 ]; then
  log "stock copy of $SRC"
  mkdir "$OUT/stock"
  tar -C "$SRC" --exclude=nvidia/nv-kernel.o_binary -cf - . | tar -C "$OUT/stock" -xf -
  add_nvconftest "$OUT/stock"
  log "stock build ($ARCH, $KREL)"
  build "$OUT/stock" stock || { log "STOCK BUILD FAILED (see $OUT/stock.log)"; tail -20 "$OUT/stock.log" >&3; exit 1; }
  STOCK_S=$(cat "$OUT/stock.seconds")
  warnings "$OUT/stock.log" "$OUT/stock" > "$OUT/stock.warnings"
  undefined "$OUT/stock/nvidia-uvm.ko" > "$OUT/stock.undefined"
  rm -rf "$OUT/stock"   # keep logs only
fi

log "apply step"
PYTHONPATH="$REPO/daemon${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m spark_memsaver patch apply \
  --source "$SRC" --dest "$OUT/patched" --slim --json > "$OUT/apply.json"
add_nvconftest "$OUT/patched"
log "patched build ($ARCH, $KREL)"
PATCHED_RC=0
build "$OUT/patched" patched || PATCHED_RC=$?
KO="$OUT/patched/nvidia-uvm.ko"

FAIL=()
[ "$PATCHED_RC" = 0 ] && [ -f "$KO" ] || FAIL+=("patched build failed rc=$PATCHED_RC")
warnings "$OUT/patched.log" "$OUT/patched" > "$OUT/patched.warnings"
OURS=$(grep -E 'uvm_pt_pack|spark-memsaver|pt_pack_' "$OUT/patched.warnings" || true)
[ -z "$OURS" ] || FAIL+=("warnings from our code: $(echo "$OURS" | head -3 | tr '\n' ' ')")
# uvm_mmu.[ch] warnings: anything there must also be present in the stock build.
MMU=$(grep -E '^nvidia-uvm/uvm_mmu\.[ch]:' "$OUT/patched.warnings" || true)
if [ "$STOCK" = 1 ]; then
  NEW=$(comm -13 "$OUT/stock.warnings" "$OUT/patched.warnings" || true)
  [ -z "$NEW" ] || FAIL+=("new warnings vs stock: $(echo "$NEW" | head -3 | tr '\n' ' ')")
elif [ -n "$MMU" ]; then
  FAIL+=("warnings in uvm_mmu.[ch] (no stock build to compare): $(echo "$MMU" | head -3 | tr '\n' ' ')")
fi
if [ -f "$KO" ]; then
  undefined "$KO" > "$OUT/patched.undefined"
  undefined_ours "$OUT/patched" "$KO" > "$OUT/patched.undefined-ours"
  NEWU=$(cat "$OUT/patched.undefined-ours")
  if [ "$STOCK" = 1 ]; then
    NEWU="$NEWU $(comm -13 "$OUT/stock.undefined" "$OUT/patched.undefined" || true)"
    NEWU=$(echo $NEWU)
  fi
  [ -z "$NEWU" ] || FAIL+=("undefined symbols: $(echo $NEWU)")
  PARMS=$(modinfo_f parm "$KO" | sed -n 's/^\(uvm_pt_pack[a-z_]*\):.*/\1/p' | sort | tr '\n' ' ')
  TAG=$(modinfo_f spark_memsaver "$KO")
  KOVER=$(modinfo_f version "$KO")
  VERMAGIC=$(modinfo_f vermagic "$KO")
  ELF=$(readelf -h "$KO" | sed -n 's/^ *Machine: *//p')
  [ "$PARMS" = "uvm_pt_pack uvm_pt_pack_stats " ] || FAIL+=("parameters: '$PARMS'")
  [ "$TAG" = "uvm-pt-pack/1" ] || FAIL+=("spark_memsaver tag: '$TAG'")
  [ "$KOVER" = "$VERSION" ] || FAIL+=("module version '$KOVER' != $VERSION")
  case "$VERMAGIC" in "$KREL "*) ;; *) FAIL+=("vermagic '$VERMAGIC' is not for $KREL") ;; esac
  case "$ELF" in *"$MACHINE"*) ;; *) FAIL+=("ELF machine: $ELF") ;; esac
  PACKSYMS=$(${CROSS}nm "$KO" | grep -c ' uvm_pt_pack_alloc$\| uvm_pt_pack_free$' || true)
  [ "$PACKSYMS" = 2 ] || FAIL+=("pool functions not linked in ($PACKSYMS)")
fi
PAGE64K=null
[ "$ARCH" = arm64 ] && { grep -q '^CONFIG_ARM64_64K_PAGES=y' "$SYSOUT/.config" && PAGE64K=true || PAGE64K=false; }

NW_STOCK=$( [ -f "$OUT/stock.warnings" ] && wc -l < "$OUT/stock.warnings" || echo null)
NW_PATCHED=$(wc -l < "$OUT/patched.warnings")
STATUS=pass; [ ${#FAIL[@]} = 0 ] || STATUS=fail
"$PYTHON" - "$OUT/result.json" <<EOF
import json, sys
null, true, false = None, True, False
fail = """$(printf '%s\n' "${FAIL[@]:-}")""".strip().splitlines()
json.dump({"version": "$VERSION", "arch": "$ARCH", "kernel": "$KREL", "arm64_64k_pages": $PAGE64K,
           "status": "$STATUS", "failures": fail,
           "stock_seconds": $STOCK_S, "patched_seconds": $(cat "$OUT/patched.seconds"),
           "warnings_stock": $NW_STOCK, "warnings_patched": $NW_PATCHED,
           "parms": "${PARMS:-}".split(), "spark_memsaver": "${TAG:-}", "module_version": "${KOVER:-}",
           "vermagic": "${VERMAGIC:-}", "modpost": "KBUILD_MODPOST_WARN=1 (compile-only)"},
          open(sys.argv[1], "w"), indent=2)
EOF
# Keep the .ko and logs; drop the object files to save space.
find "$OUT/patched" -name '*.o' -delete 2>/dev/null || true
echo "$STATUS $VERSION $ARCH $KREL stock=${STOCK_S}s patched=$(cat "$OUT/patched.seconds")s warnings stock=$NW_STOCK patched=$NW_PATCHED ${FAIL[*]:-}"
[ "$STATUS" = pass ]
