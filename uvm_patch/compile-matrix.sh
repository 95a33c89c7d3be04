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
# Environment: JOBS (default 2), STOCK=0 to skip the stock build, PYTHON (default /usr/bin/python3),
#   OF_GPIO_SHIM=1: where the kernel has no <linux/of_gpio.h> (removed in Linux 7.2), put an empty one into
#   BOTH trees' common/inc/linux/ (NVIDIA's nv-linux.h includes it unconditionally; only nvidia.ko's DSI
#   panel code uses it, never nvidia-uvm). Not a fix of NVIDIA's tree: a way to compile past it, recorded
#   in result.json ("shims"); without it such a kernel gives "stock-fails".
#   OURS_ONLY=1 (implies STOCK=0): the conftests and our two objects (uvm_mmu.o, uvm_pt_pack.o) only, no
#   module: no warning in uvm_mmu.[ch]/uvm_pt_pack.[ch], W=1 clean -> status "ours-compile" (exit 0).
# Also checked: uvm_pt_pack.o is rebuilt alone with W=1 inside the patched module build (kbuild single
#   target, same flags + W=1); a warning in uvm_pt_pack.[ch] fails the cell.
# Output: OUTDIR/{stock,patched,w1}.log, OUTDIR/result.json, one summary line on stdout.
# Exit 0 = pass, 1 = fail (ours, or a broken run), 3 = stock-fails: the unpatched tree does not build on this
#   kernel and the patched one fails with the same first error (NVIDIA's, not ours).
set -euo pipefail

usage() { sed -n '2,3p' "$0" >&2; exit 2; }
[ $# -ge 3 ] || usage
SRC=$(realpath "$1"); KDIR=$(realpath "$2"); ARCH=$3
HERE=$(dirname "$(realpath "$0")"); REPO=$(dirname "$HERE")
JOBS=${JOBS:-2}; STOCK=${STOCK:-1}; PYTHON=${PYTHON:-/usr/bin/python3}; OF_GPIO_SHIM=${OF_GPIO_SHIM:-0}
OURS_ONLY=${OURS_ONLY:-0}; [ "$OURS_ONLY" = 1 ] && STOCK=0

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

SHIMS=()
if [ "$OF_GPIO_SHIM" = 1 ] && [ ! -e "$SYSSRC/include/linux/of_gpio.h" ]; then SHIMS+=(linux/of_gpio.h); fi

add_nvconftest() {  # $1 tree: conftest lists borrowed from nvidia.Kbuild, no obj-m (+ the shims, if any)
  mkdir -p "$1/nvconftest"
  { echo "# compile-matrix: conftest lists of nvidia.Kbuild only (no module)"
    grep -E '^NV_CONFTEST' "$1/nvidia/nvidia.Kbuild"; } > "$1/nvconftest/nvconftest.Kbuild"
  local h
  for h in ${SHIMS[@]+"${SHIMS[@]}"}; do  # found after the kernel's include dirs (-I common/inc comes later)
    mkdir -p "$1/common/inc/$(dirname "$h")"
    printf '/* compile-matrix OF_GPIO_SHIM: %s is gone from this kernel; nvidia-uvm uses none of it */\n' \
      "$h" > "$1/common/inc/$h"
  done
}

errors() {  # $1 log, $2 tree -> every compiler error, "file: error: text" (line numbers dropped), sorted
  { grep -E '(fatal error|error): ' "$1" || true; } | grep -v '^make' \
    | sed -e "s#$2/##g" -e 's#^\(\./\)*##' -e 's#^\([^:]*\):[0-9]*:[0-9]*:#\1:#' | sort -u || true
}

first_error() {  # $1 log, $2 tree -> first compiler/make error, tree path and column dropped
  grep -m1 -E '(fatal error|error): ' "$1" | sed -e "s#$2/##g" -e 's#^\(\./\)*##' -e 's#^\([^:]*:[0-9]*\):[0-9]*:#\1:#' || true
}

# CC as NVIDIA's Makefile picks it (CONFIG_CC_VERSION_TEXT's first word, when on PATH), for the W=1 step.
CCX=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\([^ "]*\).*/\1/p' "$SYSOUT/.config")
command -v "$CCX" >/dev/null 2>&1 || CCX=gcc
[ "$ARCH" = x86_64 ] || CCX=${CROSS}gcc   # cross builds name CC explicitly (MAKEARCH)
kbuild_targets() {  # $1 tree, $2 log name, $3.. make args/targets: kbuild directly, as NVIDIA's Makefile calls it
  local t=$1 name=$2 kb=() t0 rc=0; shift 2
  [ "$SYSOUT" = "$SYSSRC" ] || kb=(KBUILD_OUTPUT="$SYSOUT")
  t0=$(date +%s)
  ( cd "$t" && env KBUILD_MODPOST_WARN=1 nice -n 5 make -k -j"$JOBS" -C "$SYSSRC" ${kb[@]+"${kb[@]}"} M="$t" \
        "CC=$CCX" "${MAKEARCH[@]}" NV_KERNEL_SOURCES="$SYSSRC" NV_KERNEL_OUTPUT="$SYSOUT" \
        NV_KERNEL_MODULES="nvconftest nvidia-uvm" NV_SPECTRE_V2=0 "$@" ) > "$OUT/$name.log" 2>&1 || rc=$?
  echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"
  return $rc
}
w1_pool() {  # $1 tree: rebuild nvidia-uvm/uvm_pt_pack.o alone, same kbuild flags + W=1 -> $OUT/w1.log
  rm -f "$1/nvidia-uvm/uvm_pt_pack.o"
  kbuild_targets "$1" w1 W=1 nvidia-uvm/uvm_pt_pack.o
}

build() {  # $1 tree, $2 name -> $OUT/$2.log, $OUT/$2.seconds, rc
  local t0 rc=0
  t0=$(date +%s)
  # -k: on a kernel the stock tree does not build on, every object that can compile does (ours included)
  ( cd "$1" && env KBUILD_MODPOST_WARN=1 nice -n 5 make -k -j"$JOBS" "${MAKEARCH[@]}" \
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
  # $2 = "-" (no module linked: a stock-fails cell): what the built objects define stands for the module
  local t=$1
  comm -23 <(${CROSS}nm -u "$t/nvidia-uvm/uvm_pt_pack.o" "$t/nvidia-uvm/uvm_mmu.o" | awk 'NF==2 {print $2}' | sort -u) \
    <( { awk '{print $2}' "$SYSOUT/Module.symvers"
         if [ "$2" = - ]; then find "$t/nvidia-uvm" -name '*.o' -print0 | xargs -0 ${CROSS}nm --defined-only \
           | awk 'NF==3 {print $3}'; else ${CROSS}nm --defined-only "$2" | awk '{print $3}'; fi
         find "$t/nvidia-uvm" -name '*.o' ! -name uvm_pt_pack.o ! -name uvm_mmu.o -print0 \
           | xargs -0 ${CROSS}nm -u | awk 'NF==2 {print $2}'; } | sort -u ) || true
}

STOCK_S=null; STOCK_RC=0; STOCK_ERR=""
if [ "$STOCK" = 1 ]; then
  log "stock copy of $SRC"
  mkdir "$OUT/stock"
  tar -C "$SRC" --exclude=nvidia/nv-kernel.o_binary -cf - . | tar -C "$OUT/stock" -xf -
  add_nvconftest "$OUT/stock"
  log "stock build ($ARCH, $KREL)"
  build "$OUT/stock" stock || STOCK_RC=$?
  STOCK_S=$(cat "$OUT/stock.seconds")
  if [ "$STOCK_RC" = 0 ] && [ -f "$OUT/stock/nvidia-uvm.ko" ]; then
    warnings "$OUT/stock.log" "$OUT/stock" > "$OUT/stock.warnings"
    undefined "$OUT/stock/nvidia-uvm.ko" > "$OUT/stock.undefined"
  else
    [ "$STOCK_RC" != 0 ] || STOCK_RC=1
    STOCK_ERR=$(first_error "$OUT/stock.log" "$OUT/stock")
    errors "$OUT/stock.log" "$OUT/stock" > "$OUT/stock.errors"
    log "STOCK BUILD FAILED: ${STOCK_ERR:-rc=$STOCK_RC} (see $OUT/stock.log); building the patched tree to compare"
  fi
  # conftest results depend on the kernel, conftest.sh and the flags only: the patched build reuses them
  # (REUSE_CONFTEST=0 reruns them) once every conftest header exists (the first object waits for all).
  # our hooked object's undefined symbols, stock version (the reference where no module links)
  [ ! -f "$OUT/stock/nvidia-uvm/uvm_mmu.o" ] || ${CROSS}nm -u "$OUT/stock/nvidia-uvm/uvm_mmu.o" \
    | awk 'NF==2 {print $2}' | sort -u > "$OUT/stock.mmu.undefined"
  if [ "${REUSE_CONFTEST:-1}" = 1 ] && [ -f "$OUT/stock/conftest/headers.h" ] && [ -f "$OUT/stock/conftest/functions.h" ]; then
    cp -a "$OUT/stock/conftest" "$OUT/conftest.reuse"
  fi
  rm -rf "$OUT/stock"   # keep logs only
fi

log "apply step"
PYTHONPATH="$REPO/daemon${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m spark_memsaver patch apply \
  --source "$SRC" --dest "$OUT/patched" --slim --json > "$OUT/apply.json"
add_nvconftest "$OUT/patched"
CONFTEST_REUSED=false
if [ -d "$OUT/conftest.reuse" ] && cmp -s "$SRC/conftest.sh" "$OUT/patched/conftest.sh"; then
  cp -a "$OUT/conftest.reuse" "$OUT/patched/conftest"
  T=$(( $(date +%s) + 1 )); find "$OUT/patched/conftest" -exec touch -h -d "@$T" {} +   # newer than conftest.sh
  CONFTEST_REUSED=true
fi
rm -rf "$OUT/conftest.reuse"
REUSED_NOTE=""; [ "$CONFTEST_REUSED" = false ] || REUSED_NOTE=", conftest results of the stock build"
log "patched build ($ARCH, $KREL$REUSED_NOTE)"
PATCHED_RC=0
if [ "$OURS_ONLY" = 1 ]; then  # conftests + our two objects only (no module, no link)
  kbuild_targets "$OUT/patched" patched nvidia-uvm/uvm_mmu.o nvidia-uvm/uvm_pt_pack.o || PATCHED_RC=$?
else
  build "$OUT/patched" patched || PATCHED_RC=$?
fi
KO="$OUT/patched/nvidia-uvm.ko"
# From here on only checks: each adds to FAIL, none may end the script early.
set +e +o pipefail
PATCHED_ERR=""
[ "$PATCHED_RC" = 0 ] && [ -f "$KO" ] || PATCHED_ERR=$(first_error "$OUT/patched.log" "$OUT/patched")
errors "$OUT/patched.log" "$OUT/patched" > "$OUT/patched.errors"
OURS_BUILT=$(for o in uvm_pt_pack.o uvm_mmu.o; do [ ! -f "$OUT/patched/nvidia-uvm/$o" ] || echo "$o"; done | tr '\n' ' ')
W1_WARN=null; W1_OURS=null; W1_RC=0
if [ -f "$OUT/patched/nvidia-uvm/uvm_pt_pack.o" ]; then
  log "uvm_pt_pack.o again with W=1"
  W1_RC=0; w1_pool "$OUT/patched" || W1_RC=$?
  W1_WARN=$(grep -c 'warning: ' "$OUT/w1.log" || true)
  W1_OURS=$( { grep -E 'uvm_pt_pack\.[ch]:[0-9]+:[0-9]+: warning: ' "$OUT/w1.log" || true; } | sort -u | wc -l)
fi

FAIL=()
if [ "$W1_OURS" != null ]; then
  [ "$W1_RC" = 0 ] && [ -f "$OUT/patched/nvidia-uvm/uvm_pt_pack.o" ] || FAIL+=("W=1 rebuild of uvm_pt_pack.o failed rc=$W1_RC (see w1.log)")
  grep -q 'CC \[M\] .*nvidia-uvm/uvm_pt_pack\.o' "$OUT/w1.log" || FAIL+=("W=1 step did not compile uvm_pt_pack.o")
  # scripts/Makefile.extrawarn's W=1 set really reached the compiler (it defines KBUILD_EXTRA_WARN1)
  grep -q -- '-DKBUILD_EXTRA_WARN1' "$OUT/patched/nvidia-uvm/.uvm_pt_pack.o.cmd" 2>/dev/null \
    || FAIL+=("W=1 flags missing from uvm_pt_pack.o's command line")
  [ "$W1_OURS" = 0 ] || FAIL+=("W=1 warnings in uvm_pt_pack.[ch]: $(grep -E 'uvm_pt_pack\.[ch]:[0-9]+:[0-9]+: warning: ' "$OUT/w1.log" | head -3 | tr '\n' ' ')")
else
  FAIL+=("uvm_pt_pack.o was not built")
fi
if [ "$OURS_ONLY" = 1 ]; then
  [ "$OURS_BUILT" = "uvm_pt_pack.o uvm_mmu.o " ] || FAIL+=("our objects not built (${OURS_BUILT:-none}): ${PATCHED_ERR:-no error line}")
else
  [ "$PATCHED_RC" = 0 ] && [ -f "$KO" ] || FAIL+=("patched build failed rc=$PATCHED_RC: ${PATCHED_ERR:-no error line}")
fi
warnings "$OUT/patched.log" "$OUT/patched" > "$OUT/patched.warnings"
OURS=$(grep -E 'uvm_pt_pack|spark-memsaver|pt_pack_' "$OUT/patched.warnings" || true)
[ -z "$OURS" ] || FAIL+=("warnings from our code: $(echo "$OURS" | head -3 | tr '\n' ' ')")
# uvm_mmu.[ch] warnings: anything there must also be present in the stock build.
MMU=$(grep -E '^nvidia-uvm/uvm_mmu\.[ch]:' "$OUT/patched.warnings" || true)
if [ "$STOCK" = 1 ] && [ "$STOCK_RC" = 0 ]; then
  NEW=$(comm -13 "$OUT/stock.warnings" "$OUT/patched.warnings" || true)
  [ -z "$NEW" ] || FAIL+=("new warnings vs stock: $(echo "$NEW" | head -3 | tr '\n' ' ')")
elif [ -n "$MMU" ]; then
  FAIL+=("warnings in uvm_mmu.[ch] (no stock build to compare): $(echo "$MMU" | head -3 | tr '\n' ' ')")
fi
if [ -f "$KO" ]; then
  undefined "$KO" > "$OUT/patched.undefined"
  undefined_ours "$OUT/patched" "$KO" > "$OUT/patched.undefined-ours"
  NEWU=$(cat "$OUT/patched.undefined-ours")
  if [ "$STOCK" = 1 ] && [ "$STOCK_RC" = 0 ]; then
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
elif [ "$OURS_BUILT" = "uvm_pt_pack.o uvm_mmu.o " ] && [ -f "$OUT/stock.mmu.undefined" ]; then
  # no module linked: what our two objects need beyond the stock uvm_mmu.o's needs, the kernel's exports
  # and what the built objects of the module define (what the .ko would provide)
  P=$OUT/patched/nvidia-uvm
  comm -23 <(${CROSS}nm -u "$P/uvm_pt_pack.o" "$P/uvm_mmu.o" | awk 'NF==2 {print $2}' | sort -u) \
    <( { cat "$OUT/stock.mmu.undefined"; awk '{print $2}' "$SYSOUT/Module.symvers"
         find "$P" -name '*.o' ! -name '*.mod.o' -print0 | xargs -0 ${CROSS}nm --defined-only 2>/dev/null \
           | awk 'NF==3 {print $3}'; } | sort -u ) \
    > "$OUT/patched.undefined-ours"
  NEWU=$(echo $(cat "$OUT/patched.undefined-ours"))
  [ -z "$NEWU" ] || FAIL+=("undefined symbols of our objects beyond the stock uvm_mmu.o's: $NEWU")
fi
PAGE64K=null
[ "$ARCH" = arm64 ] && { grep -q '^CONFIG_ARM64_64K_PAGES=y' "$SYSOUT/.config" && PAGE64K=true || PAGE64K=false; }

NW_STOCK=$( [ -f "$OUT/stock.warnings" ] && wc -l < "$OUT/stock.warnings" || echo null)
NW_PATCHED=$(wc -l < "$OUT/patched.warnings")
STATUS=pass; [ ${#FAIL[@]} = 0 ] || STATUS=fail
[ "$OURS_ONLY" = 1 ] && [ "$STATUS" = pass ] && STATUS=ours-compile
NERR_STOCK=$( [ -f "$OUT/stock.errors" ] && wc -l < "$OUT/stock.errors" || echo 0)
NERR_PATCHED=$(wc -l < "$OUT/patched.errors")
if [ "$STOCK_RC" != 0 ]; then
  # The unpatched tree does not build here. Not ours only if the patched tree fails with exactly the same
  # errors (line numbers dropped) and everything else of ours still holds: our objects compiled where the
  # stock ones did, no warning from our code, W=1 clean, no undefined symbol of our objects that the built
  # objects + kernel do not provide. (No module is linked: no .ko checks.)
  OTHER=()
  for f in ${FAIL[@]+"${FAIL[@]}"}; do case "$f" in "patched build failed"*) ;; *) OTHER+=("$f") ;; esac; done
  if [ "$NERR_STOCK" -gt 0 ] && cmp -s "$OUT/stock.errors" "$OUT/patched.errors" && [ ${#OTHER[@]} = 0 ] \
     && ! grep -q 'nvidia-uvm/uvm_pt_pack\.[ch]:' "$OUT/stock.errors"; then
    STATUS=stock-fails
    # (an error in a shared header can stop uvm_mmu.c in both; where the stock one compiled, ours must)
    if [ -f "$OUT/stock.mmu.undefined" ]; then case "$OURS_BUILT" in *uvm_mmu.o*) ;; *)
      STATUS=fail; FAIL+=("uvm_mmu.o not built although the stock build built it") ;; esac; fi
  else
    STATUS=fail
    FAIL+=("stock build failed (${STOCK_ERR:-rc=$STOCK_RC}); patched errors differ: $(comm -13 "$OUT/stock.errors" "$OUT/patched.errors" 2>/dev/null | head -3 | tr '\n' ' ')")
  fi
fi
POOL_SHA=$(sha256sum "$OUT/patched/nvidia-uvm/uvm_pt_pack.c" 2>/dev/null | cut -c1-16)
CCTEXT=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\(.*\)"$/\1/p' "$SYSOUT/.config")
CCUSED=$("$CCX" --version 2>/dev/null | sed -n 1p)
PAGESZ=4096
if [ "$ARCH" = arm64 ]; then
  if grep -q '^CONFIG_ARM64_16K_PAGES=y' "$SYSOUT/.config"; then PAGESZ=16384; fi
  if grep -q '^CONFIG_ARM64_64K_PAGES=y' "$SYSOUT/.config"; then PAGESZ=65536; fi
fi
"$PYTHON" - "$OUT/result.json" <<EOF
import json, sys
null, true, false = None, True, False
fail = """$(printf '%s\n' "${FAIL[@]:-}")""".strip().splitlines()
json.dump({"version": "$VERSION", "arch": "$ARCH", "kernel": "$KREL", "arm64_64k_pages": $PAGE64K,
           "status": "$STATUS", "failures": fail,
           "stock_seconds": $STOCK_S, "patched_seconds": $(cat "$OUT/patched.seconds"),
           "warnings_stock": $NW_STOCK, "warnings_patched": $NW_PATCHED,
           "parms": "${PARMS:-}".split(), "spark_memsaver": "${TAG:-}", "module_version": "${KOVER:-}",
           "vermagic": "${VERMAGIC:-}", "modpost": "KBUILD_MODPOST_WARN=1 (compile-only)",
           "page_size": $PAGESZ, "stock_error": """$STOCK_ERR""" or None, "patched_error": """$PATCHED_ERR""" or None,
           "w1_warnings_total": $W1_WARN, "w1_warnings_ours": $W1_OURS,
           "shims": "${SHIMS[*]:-}".split(), "pool_sha256_16": "${POOL_SHA:-}",
           "kernel_cc": """$CCTEXT""", "cc_used": """$CCUSED""",
           "undefined_new": "${NEWU:-}".split(), "conftest_reused": $CONFTEST_REUSED,
           "ours_only": $([ "$OURS_ONLY" = 1 ] && echo true || echo false), "errors_stock": $NERR_STOCK, "errors_patched": $NERR_PATCHED, "ours_built": "$OURS_BUILT".split()},
          open(sys.argv[1], "w"), indent=2)
EOF
# Keep the .ko and logs; drop the object files to save space.
find "$OUT/patched" -name '*.o' -delete 2>/dev/null || true
echo "$STATUS $VERSION $ARCH ${PAGESZ} $KREL stock=${STOCK_S}s patched=$(cat "$OUT/patched.seconds")s warnings stock=$NW_STOCK patched=$NW_PATCHED w1=$W1_OURS/$W1_WARN ${SHIMS[*]:+shims=${SHIMS[*]}} ${STOCK_ERR:+stock_error=$STOCK_ERR} ${FAIL[*]:-}"
case "$STATUS" in pass|ours-compile) exit 0 ;; stock-fails) exit 3 ;; *) exit 1 ;; esac
