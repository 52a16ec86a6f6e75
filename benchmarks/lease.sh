#!/usr/bin/env bash
# The lease kit: everything a lent GPU should measure, in parts, each under its own timeout, with
# everything kept for reading afterwards on a CPU (benchmarks/lease_report.py).
#
#   bash benchmarks/lease.sh                 # the first call's parts (= call1), in value order
#   bash benchmarks/lease.sh call2           # the second call's parts
#   bash benchmarks/lease.sh moe ncu         # named parts only (a rerun on the still-warm machine)
#   bash benchmarks/lease.sh --dry [PART..]  # every part on the CPU at tiny shapes (LEASE_DRY=1 too)
#
# A lease is 15 minutes of device time, the machine's start (1-2 minutes) and idle time included. Two
# calls, the second right after the first while the machine is warm: the first of at most 9 minutes
# (run's timeout_s=540; its parts' budgets sum to LEASE_SECONDS=505, leaving time to package), the
# second with what is left (status's budget_left_s): LEASE_SECONDS = budget_left_s - 60 and
# timeout_s = budget_left_s - 30, its parts cut to the time left in order. Budgets (seconds, each the
# hard limit of the part's timeout -s INT), the most valuable parts first:
#
#   call1  setup 35     install the checkout (--no-deps) and the carried torchao wheel; env.json; then
#                       $WORK/setup.done, so a later setup on the same machine skips pip (22 s measured)
#          ceilings 25  copy bandwidth (do_bench and CUDA-graph replay), bf16 / FP8 GEMM at 8192^3,
#                       torch._scaled_mm with and without fast accumulation at the step's GEMM shapes,
#                       and with an fp32 output at its wgrad shapes (te's under autocast over fp32
#                       weights), torch._grouped_mm against torch._scaled_grouped_mm at the MoE shapes
#                       (15 s measured before the fp32-output cases, about 2 s more)
#          step 210     bench_step.py: the Llama 3 8B-shaped 4-layer step, 1 x 8192 tokens: bf16, te
#                       Float8CurrentScaling, te DelayedScaling, torchao float8 tensorwise, each in its own
#                       process (36, 50, 53, 50 s measured, ~190 s with the parent)
#          moe 235      bench_moe.py: one MoE layer, Mixtral-like then small experts in each provider's
#                       process: bf16, te Float8CurrentScaling, te ... E4M3, torchao MoE float8 rowwise
#                       (~48 s for bf16's process, ~60 s for te's: estimated from the first lease's 180 s)
#   call2  setup 10     setup.done is there: no pip show, no env.json (their imports took 21 s and were
#                       stopped at 20 on the first lease)
#          attention 160  bench_attention.py: FP8 attention against SDPA at 4 x 32 x 4096 x 128, three
#                       processes, the SDPA backend that ran logged
#          kernels 75   bench_quantize.py: the quantize and RMSNorm + quantize kernels in GB/s against
#                       copy, each block-format kernel beside inductor's code for its reference (three
#                       compiles, ~30 s estimated, more than the 39 s measured without them), and the FP8
#                       GEMM epilogue experiment
#          offload 120  bench_step.py's step with the saved activations offloaded to host memory: te
#                       Float8CurrentScaling ([memory] offload_activations) and bf16 (torch's partitioner
#                       flags), peak memory, step time and bytes moved against the step part's rows
#                       (two processes of ~50 s; a torch without the offload machinery fails them at
#                       compile time with the missing flag in the log)
#          combo 110    bench_step.py's step with te's combo_kernels key (inductor's combo kernels), current
#                       and delayed scaling, against the step part's te rows: offline it cuts the step's
#                       launches from 410 to 279 and from 471 to 303 at the same bytes (two processes)
#          accum 180    bench_step.py's step as 4 gradient-accumulation micro-batches + AdamW: bf16, te
#                       Float8CurrentScaling, and te with cache_fp8_weights (each weight quantized once per
#                       step): offline a micro-batch after the first moves 38.3 GB instead of 53.0 (three
#                       processes, no profile)
#          smoke 110    a Hugging Face Llama trains 50 steps under bf16 and te (two compiles): final loss
#                       within 1% (44 s was not enough)
#          tests 150    the CUDA tests (pytest -n 8, --junitxml), stopped by SIGINT so the summary is written
#          ncu 90       Nsight Compute (--clock-control none) on te's slowest Triton kernels of the step,
#                       whose te process it reruns on the step's cache (see below)
#   by name only: block 250  bench_block.py, the GPT block step at 2 x 2048 x 4096 (the earlier leases'
#                       figure, which the step supersedes)
#                 linear 200  bench_linear.py: one linear forward + backward at 4096^3, 8192 x 4096 x 1024
#                       (Llama's k/v projections) and 8192^3, te with and without [rewrite] small_gemms's
#                       high-precision line, which these figures move
#
# Why this plan (the first lease, on an H100, 2026-11-27): a provider's process needs 36-53 s (imports and
# model build 9-12 s, the first step's compile 14-34 s, timed steps ~6 s, profile 1-2 s), so a part that
# splits its budget evenly over providers (block: 110 s over five, attention: 50 s over three) stops every
# process while it compiles and brings back nothing. lease_parts.py now starts a provider only with at least
# PROCESS_MIN_SECONDS left and hands what is left on to the next. The step ran its four useful providers in
# 190 s; torchao rowwise, no goal's reference, is dropped from it. The MoE layer gets the rest of call1: its
# small-expert shape rides in the same processes (a compile more, not a process more) and its rows are
# written after the Mixtral ones, so a stopped process keeps those. Call2 (~325 s on that lease) holds
# setup, attention, kernels and smoke; tests and ncu, last by value, run only where a call has time left
# (or by name on a later lease: bash benchmarks/lease.sh tests ncu). ncu compiled the block afresh under the profiler
# and used its whole 70 s doing so; it now profiles the step's te process reading the step's inductor and
# Triton cache, a cache hit.
#
# Every provider is compiled once per process, and that compile serves the timed steps, the profile,
# the generated code (a TORCHINDUCTOR_CACHE_DIR per provider) and ncu (which finds it in that cache).
# Steps are timed by CUDA events over back-to-back steps, kernels by triton.testing.do_bench.
#
# Where things go: the work folder LEASE_WORK (default /tmp/te_lease, outside the checkout, whose device
# copy is lost) collects every part's rows, profiles, code and logs across the calls of one lease, and
# each call ends by packaging it into $OUT (the device tool's return folder; ./lease_out elsewhere) as
# the 8 files the tool brings back, each under 16 MiB:
#   summary.txt (also printed last), results.jsonl, kernels.csv, traces.tar.gz, inductor_code.tar.gz,
#   ncu.tar.gz, logs.tar.gz, timings.tsv
# The second call's files hold both calls' rows. Commit results.jsonl as
# benchmarks/results/<date>-<device>.jsonl and read the rest with `python benchmarks/lease_report.py OUT`.
#
# Environment: PYTHON (default python3, the image's, which holds torch), LEASE_WORK, OUT, LEASE_SECONDS,
# TE_COMPILE_REV (the git revision, for the rows: the device's copy of the tree has no .git).
# torchao comes as a wheel in .whl/ (git-ignored; name it in run's carry).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$SECONDS

DRY=${LEASE_DRY:-0}
parts=()
part_only=""
if [ "${1:-}" = __part ]; then part_only=$2; part_limit=$3; set --; fi   # one part, inside its timeout
for arg in "$@"; do
    case "$arg" in
        --dry) DRY=1 ;;
        call1) parts+=(setup ceilings step moe) ;;
        call2) parts+=(setup attention kernels offload combo accum smoke tests ncu) ;;
        all) parts+=(setup ceilings step moe attention kernels offload combo accum smoke tests ncu block linear) ;;
        setup|ceilings|step|moe|block|linear|attention|kernels|offload|combo|accum|smoke|ncu|tests) parts+=("$arg") ;;
        *) echo "lease.sh: unknown part '$arg'; parts: setup ceilings step moe attention kernels offload combo" \
                "accum smoke tests ncu block linear, or call1, call2, all, and --dry" >&2; exit 2 ;;
    esac
done
[ ${#parts[@]} -eq 0 ] && parts=(setup ceilings step moe)

PY=${PYTHON:-python3}
if [ "$DRY" = 1 ]; then
    WORK=${LEASE_WORK:-/tmp/te_lease_dry}
    OUT=${OUT:-$ROOT/lease_out}
    DEADLINE=${LEASE_SECONDS:-900}
    export CUDA_VISIBLE_DEVICES=""
    export TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1   # CPU kernels named in the profile, as GPU ones are
else
    WORK=${LEASE_WORK:-/tmp/te_lease}
    OUT=${OUT:-$ROOT/lease_out}
    DEADLINE=${LEASE_SECONDS:-505}
fi
mkdir -p "$WORK/logs" "$OUT"
export LEASE_WORK=$WORK LEASE_DRY=$DRY PYTHON=$PY OUT PYTHONUNBUFFERED=1
export LEASE_RUN=${LEASE_RUN:-$(date -u +%Y%m%dT%H%M%SZ)}
# inductor writes each Triton kernel's byte estimate (kernel_num_gb) into the generated code
export TORCHINDUCTOR_BENCHMARK_KERNEL=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$WORK/site/torchao" ] && export PYTHONPATH="$WORK/site:$PYTHONPATH"

# written after a setup that succeeded: this work folder's machine has the checkout and torchao installed
SETUP_DONE=$WORK/setup.done

# budget PART: seconds on a GPU (the header's plan); a dry part gets 150
budget() {
    if [ "$DRY" = 1 ]; then echo 150; return; fi
    case "$1" in
        setup) if [ -f "$SETUP_DONE" ]; then echo 10; else echo 35; fi ;;
        ceilings) echo 25 ;; step) echo 210 ;; moe) echo 235 ;; block) echo 250 ;; linear) echo 200 ;;
        attention) echo 160 ;; kernels) echo 75 ;; offload) echo 120 ;; combo) echo 110 ;; accum) echo 180 ;;
        smoke) echo 110 ;; tests) echo 150 ;; ncu) echo 90 ;;
    esac
}

install() {
    if [ "$DRY" = 1 ]; then echo "dry: the checkout and its environment as they are"; return 0; fi
    if ! "$PY" -m pip show -q te_compile > /dev/null 2>&1; then
        "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . || return 1
    fi
    if ls .whl/torchao-*.whl > /dev/null 2>&1 && [ ! -d "$WORK/site/torchao" ]; then
        "$PY" -m pip install --no-index --no-deps --no-compile --target "$WORK/site" .whl/torchao-*.whl || return 1
    fi
    [ -d "$WORK/site/torchao" ] && export PYTHONPATH="$WORK/site:$PYTHONPATH"
    return 0
}

# the command of each part (run in the part's timeout; its output is logs/PART.log)
part_cmd() {
    local dry_flag=()
    [ "$DRY" = 1 ] && dry_flag=(--dry)
    case "$1" in
        setup)
            # the check is the marker alone: pip show and the imports behind env.json took the 20 s a
            # second call's setup had on the first lease
            if [ "$(cat "$SETUP_DONE" 2> /dev/null)" = "$ROOT $PY" ]; then
                echo "setup: done earlier in $WORK (setup.done): pip and env.json skipped"; return 0
            fi
            install && "$PY" benchmarks/lease_parts.py setup "${dry_flag[@]}" && echo "$ROOT $PY" > "$SETUP_DONE" ;;
        ceilings) "$PY" benchmarks/lease_parts.py ceilings "${dry_flag[@]}" ;;
        block|moe|attention|kernels)
            "$PY" benchmarks/lease_parts.py bench "$1" --budget "$2" "${dry_flag[@]}" ;;
        step)
            if [ ! -f benchmarks/bench_step.py ]; then echo "step: benchmarks/bench_step.py is missing"; return 127; fi
            local providers=("bf16" "te Float8CurrentScaling" "te DelayedScaling" "torchao float8 tensorwise")
            [ "$DRY" = 1 ] && providers=("bf16" "te Float8CurrentScaling")
            "$PY" benchmarks/bench_step.py --providers "${providers[@]}" --jsonl "$WORK/results.jsonl" \
                --kernels-csv "$WORK/kernels.csv" --trace-dir "$WORK/traces" --code-dir "$WORK/code/step" \
                "${dry_flag[@]}" ;;
        offload)
            # the step's shape with the saved activations offloaded (te's and torch's own for bf16); the
            # step part's bf16 and te rows are the offload-off side
            "$PY" benchmarks/bench_step.py --providers "te Float8CurrentScaling offload" "bf16 offload" \
                --jsonl "$WORK/results.jsonl" --kernels-csv "$WORK/kernels.csv" --trace-dir "$WORK/traces" \
                --code-dir "$WORK/code/offload" --profile-steps 0 "${dry_flag[@]}" ;;
        combo)
            # the step with inductor's combo kernels in te's graphs; the step part's te rows are the default
            local providers=("te Float8CurrentScaling combo" "te DelayedScaling combo")
            [ "$DRY" = 1 ] && providers=("te DelayedScaling combo")
            "$PY" benchmarks/bench_step.py --providers "${providers[@]}" --jsonl "$WORK/results.jsonl" \
                --kernels-csv "$WORK/kernels.csv" --trace-dir "$WORK/traces" --code-dir "$WORK/code/combo" \
                "${dry_flag[@]}" ;;
        accum)
            # gradient accumulation: full steps of 4 micro-batches; the cached provider's fwd+bwd rows
            # reuse the copies throughout (no optimizer step between), so its full-step rows are the figure
            local providers=("bf16" "te Float8CurrentScaling" "te Float8CurrentScaling cached weights")
            [ "$DRY" = 1 ] && providers=("te Float8CurrentScaling cached weights")
            "$PY" benchmarks/bench_step.py --providers "${providers[@]}" --micro-batches 4 \
                --jsonl "$WORK/results.jsonl" --kernels-csv "$WORK/kernels.csv" --trace-dir "$WORK/traces" \
                --code-dir "$WORK/code/accum" --profile-steps 0 "${dry_flag[@]}" ;;
        linear)
            # the table is in logs/linear.log (each median printed as it comes) and logs/linear.json
            if [ "$DRY" = 1 ]; then
                "$PY" benchmarks/bench_linear.py --device cpu --sizes 64x64x64 --iters 2 --warmup 1 \
                    --json "$WORK/logs/linear.json"
            else
                "$PY" benchmarks/bench_linear.py --device cuda --sizes 4096x4096x4096,8192x4096x1024,8192x8192x8192 \
                    --iters 20 --json "$WORK/logs/linear.json"
            fi ;;
        smoke) "$PY" benchmarks/lease_parts.py smoke "${dry_flag[@]}" ;;
        ncu) "$PY" benchmarks/lease_parts.py ncu --budget "$2" "${dry_flag[@]}" ;;
        tests)
            if [ "$DRY" = 1 ]; then
                "$PY" benchmarks/lease_parts.py tests -- -q -n 0 -rfEs tests/test_fp_bits.py -k "e4m3 and not kernel"
            else
                # the kernel, GEMM and attention tests: on a GPU their Triton kernels compile for real
                "$PY" benchmarks/lease_parts.py tests -- -q -rfEs -n 8 --durations=20 tests/test_kernel_*.py \
                    tests/test_fp_bits.py tests/test_fp8_gemm.py tests/test_block_gemm.py tests/test_float8_tensor.py \
                    tests/test_fp8_attention.py tests/test_kernels_compile.py tests/test_experiment_*.py
            fi ;;
    esac
}

if [ -n "$part_only" ]; then
    part_cmd "$part_only" "$part_limit"
    exit $?
fi

package() {
    "$PY" benchmarks/lease_parts.py package --work "$WORK" --out "$OUT"
}
trap 'echo "lease.sh: interrupted, packaging what there is"; package; exit 130' INT TERM

for part in "${parts[@]}"; do
    left=$(( DEADLINE - (SECONDS - T0) ))
    limit=$(budget "$part")
    (( limit > left )) && limit=$left
    if (( limit < 10 )); then
        printf '%s\tskipped\t0\t%s\t%s\t%s\n' "$part" "$limit" "$(date -u +%H:%M:%S)" "$LEASE_RUN" >> "$WORK/timings.tsv"
        echo "lease: $part skipped, $left s left of this call's $DEADLINE"
        continue
    fi
    start=$SECONDS
    [ -d "$WORK/site/torchao" ] && [[ ":$PYTHONPATH:" != *":$WORK/site:"* ]] && export PYTHONPATH="$WORK/site:$PYTHONPATH"
    # SIGINT first, so pytest and the benchmarks write what they have; SIGKILL 15 s later if still running
    timeout -s INT -k 15 "$limit" bash "$ROOT/benchmarks/lease.sh" __part "$part" "$limit" > "$WORK/logs/$part.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$part" "$rc" "$((SECONDS - start))" "$limit" "$(date -u +%H:%M:%S)" \
        "$LEASE_RUN" >> "$WORK/timings.tsv"
    echo "lease: $part rc $rc in $((SECONDS - start)) s (limit $limit)"
    grep -vE "^USDT|profiler_(start|stop)" "$WORK/logs/$part.log" | tail -n 4 | sed 's/^/    /'
done
package
