#!/bin/sh
# Full randomized run of the packing pool harness (>= 10^7 operations in total):
#   - ASan+UBSan deterministic random-op driver, OPS_PER_SIZE ops at 4 KiB, 16 KiB and 64 KiB pages
#   - TSan multi-threaded stress (4 workers + a counters reader), STRESS_OPS per page size
#   - libFuzzer (clang, ASan+UBSan), FUZZ_SECONDS per page size, if clang is installed
# Prints one line per run and a total; exits non-zero on the first failure.
# Usage: tests/harness/run-fuzz.sh [SEED]   (env: OPS_PER_SIZE, STRESS_OPS, FUZZ_SECONDS)
set -eu
cd "$(dirname "$0")"
SEED=${1:-20261130}
OPS_PER_SIZE=${OPS_PER_SIZE:-3400000}
STRESS_OPS=${STRESS_OPS:-400000}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
B=build
make -s -j2 asan tsan >/dev/null
if command -v clang >/dev/null 2>&1; then make -s -j2 libfuzzer >/dev/null; HAVE_CLANG=1; else HAVE_CLANG=0; fi

total=0
for s in 12 14 16; do
	out=$($B/asan-$s/pt_harness fuzz "$OPS_PER_SIZE" $((SEED + s)))
	echo "asan+ubsan $out"
	n=$(echo "$out" | sed -n 's/.* ops=\([0-9]*\) .*/\1/p'); total=$((total + n))
done
for s in 12 14 16; do
	out=$(TSAN_OPTIONS="halt_on_error=1 exitcode=66" $B/tsan-$s/pt_harness stress "$STRESS_OPS" $((SEED + s)) 4)
	echo "tsan $out"
	n=$(echo "$out" | sed -n 's/.* ops=\([0-9]*\) .*/\1/p'); total=$((total + n))
done
if [ "$HAVE_CLANG" = 1 ]; then
	for s in 12 14 16; do
		mkdir -p $B/corpus-$s
		$B/fuzz-$s/pt_fuzz -max_total_time="$FUZZ_SECONDS" -max_len=4096 -seed=$((SEED + s)) \
			-print_final_stats=1 $B/corpus-$s >$B/libfuzzer-$s.log 2>&1
		runs=$(sed -n 's/^stat::number_of_executed_units: *//p' $B/libfuzzer-$s.log)
		n=$(sed -n 's/^fuzz-ops: .* ops=\([0-9]*\)/\1/p' $B/libfuzzer-$s.log)
		echo "libfuzzer page_size=$((1 << s)) inputs=$runs ops=$n seconds=$FUZZ_SECONDS"
		total=$((total + n))
	done
else
	echo "libfuzzer skipped: clang not installed (apt-get install clang libclang-rt-dev)"
fi
echo "total operations: $total"
[ "$total" -ge 10000000 ] || { echo "fewer than 10^7 operations" >&2; exit 1; }
