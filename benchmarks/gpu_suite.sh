#!/usr/bin/env bash
# The GPU suite: lowbitcc's checks on one lent GPU machine (an H200: 15 minutes of device time
# in all, at most 10 minutes a call), in phases, under one deadline. It measures the CUDA
# kernels against the reference bit for bit; call plans, graph replay and the hierarchical
# schedule on 2 and 4 ranks sharing the GPU; the per-call goals of a planned call (host time,
# launches, uploads, allocations); exact places, deviations and a stalled peer; the codec's
# throughput against a copy; DDP over loco against DDP over nccl; and the whole `pytest -m gpu`
# suite. docs/gpu.md, "Running the GPU suite", says what has run and what to run next; each
# phase's result line feeds its records of runs.
#
# Usage: bash benchmarks/gpu_suite.sh [--dry] [PHASE ... | all]
#   no PHASE: plans goals (the recommended first command); all: every phase, more than one
#   call holds (the plan is refused: pick). env runs first whatever is asked.
#
# Phases in order of value, with their planned seconds (the table the script reads; PHASE_S=N,
# e.g. PLANS_S=150, plans N seconds for that phase instead):
#| env       150  pip install -e . (no deps), versions, the C++ codec's and works' builds, NVRTC
#| frame     120  pytest: frame, check, encode_sum, decode_rows kernels, the call counter
#| plans     230  pytest: call plans on CUDA, host records (C++, Python), renewals, device runner
#| graphs    240  pytest: graph replay bit for bit; planned_call_goals.py --graphs: host time
#| goals     160  planned_call_goals.py: the goals per planned call (GOALS_ARGS: 2 sizes)
#| hier      200  pytest: the hierarchical schedule on NCCL node and rail groups
#| demo      200  lowbitcc demo on GPUs: DDP over loco beside DDP over nccl, 2 ranks
#| train     240  lowbitcc bench-train, fp32 and bf16: loco against nccl (TRAIN_LINK: + a link)
#| places    300  pytest: exact places, a deviation on one rank, a stalled peer (2, 4 ranks)
#| exactperf 120  lowbitcc perf: an exact 1 MiB all-reduce over loco against nccl's (<= 1.2x)
#| selftest  240  lowbitcc selftest --ranks 4 (CASES cases, 400)
#| pytest    420  pytest -m gpu: every GPU test
#| unfixed   120  the state-lifetime test without ErrorState.record_stream: does it fail?
#| schedule  240  pytest: tests/gpu/test_multirank.py, every test
#| launches  150  cuda_launches.py: kernels, memsets, copies per call, world size 1
#| perf      300  lowbitcc perf all_reduce, 1 and 2 ranks, 256 KiB to 64 MiB
#| codec     150  lowbitcc codec-bench: encode and decode against a copy from 16 MiB (>= 0.5x)
#
# Deadline: GPU_SUITE_DEADLINE_S, 540 by default (a call's 600 s less the packing and the
# transfer). A plan (env and the phases asked for) whose planned seconds exceed it is refused
# before anything runs (exit 2). Each phase runs under `timeout` (then KILL after a grace of a
# tenth, at most 10 s) with its share: what is left of the deadline divided among the phases not
# yet run by their planned seconds, at least its own. A phase whose planned seconds no longer fit
# what is left (an earlier one overran) prints SKIP, and the next is tried.
#
# Results: each phase prints one line, `PASS <phase> <number> ...`, `FAIL <phase> <reason>` or
# `SKIP <phase> (needs Ns, Ms left)`, with the seconds it took, its share and its planned seconds;
# benchmarks/gpu_suite_report.py reads them from the phase's log and JSON. Lines also in
# $OUT/summary.txt; each phase's log ($OUT/<phase>.log) and JSON go into $OUT/logs.tar.gz on exit
# (the device tool brings back 8 files a call). $OUT: the device tool's folder, else
# ./gpu-suite-out. Exit 0 where every phase passed, 1 where one did not, 2 for a refused plan.
#
# Recommended first command, one device call with timeout_s 600 (env 150 + plans 210 +
# goals 180 = 540 s):
#   bash benchmarks/gpu_suite.sh plans goals
#
# Dry mode, here on the CPU before any call: --dry (or GPU_SUITE_DRY=1) runs the same plumbing,
# each phase's commands printed into its log instead of run (the files they name checked), then
# a stand-in writing the log lines and JSON the phase would; a plan that does not fit is refused
# as it would be on the GPU. GPU_SUITE_DRY_SLEEP=S: each stand-in first sleeps S seconds,
# ignoring TERM (a hung phase: it is cut at its limit).
#   bash benchmarks/gpu_suite.sh --dry plans goals
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
self=$root/benchmarks/gpu_suite.sh
report=$root/benchmarks/gpu_suite_report.py
[ -n "${GPU_SUITE_OUT_DIR:-}" ] || GPU_SUITE_OUT_DIR=$(realpath -m "${OUT:-gpu-suite-out}")
cd "$root" || exit 2
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# this checkout's package, also for scripts run by path (`python3 -c` finds it from the root,
# benchmarks/*.py do not); pip's editable install (env) adds the entry point that registers "loco"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# a rank still running 60 s after its group was made writes its threads' stacks to the log:
# what a hang waited on (tools/spawn.py)
export LOWBITCC_DUMP_STACKS_AFTER=${LOWBITCC_DUMP_STACKS_AFTER:-60}

usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^#|\{0,1\} \{0,1\}//;p}' "$self"; }

# -- one phase's commands (run in a child: `gpu_suite.sh --phase NAME`, stdout into its log) --

out=$GPU_SUITE_OUT_DIR
dry=${GPU_SUITE_DRY:-0}
missing=0
# one command of a phase: run it, or in dry mode print it and check the files it names
x() {
    if [ "$dry" = 1 ]; then
        printf -- '--- would run:'; printf ' %q' "$@"; echo
        local arg
        for arg in "$@"; do
            case $arg in tests/*.py | benchmarks/*.py)
                [ -e "$arg" ] || { echo "--- missing file: $arg"; missing=1; } ;;
            esac
        done
        return 0
    fi
    "$@"
    local rc=$?
    [ $rc -eq 0 ] || echo "--- exit $rc: $1 ${2:-} ${3:-}"
    return $rc
}
# PCT percent of the phase's share, in seconds: the limit of a step that is not its phase's last
part() { local ms=$((GPU_SUITE_SHARE_MS * $1 / 100)); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
step() { x timeout --foreground -k 5 "$(part "$1")" "${@:2}"; }
# the suite's pytest runs: a skipped GPU test fails there (LOWBITCC_REQUIRE_GPU)
gpu_pytest=(env LOWBITCC_REQUIRE_GPU=1 "$py" -m pytest -m gpu -v -p no:cacheprovider -rs)

phase_env() {
    date -u
    x nvidia-smi -L
    x "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . ||
        echo "pip install failed: PYTHONPATH serves (then \`import lowbitcc\` registers \"loco\")"
    x "$py" - <<'EOF'
import sys, time
import setuptools, torch
gpus = torch.cuda.device_count()
try:
    import cupy
    cupy_version = cupy.__version__
except Exception as exc:  # noqa: BLE001
    cupy_version = f"missing({type(exc).__name__})"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "-"
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} "
      f"nccl {nccl} cupy {cupy_version} setuptools {setuptools.__version__}")
print(f"gpus {gpus}", *(f"({torch.cuda.get_device_name(i)})" for i in range(gpus)))
import glob, os, subprocess
for lock in glob.glob(os.path.expanduser("~/.cache/torch_extensions/lowbitcc/*/lock")):
    os.remove(lock)  # a build killed before (nothing builds yet): torch's build would wait on it
t = time.perf_counter()  # the C++ works (runner, host records' LaunchReplay) build beside the codec
works = subprocess.Popen([sys.executable, "-c", "from lowbitcc.backend import native; "
                          "raise SystemExit(native.load() is None)"])
from lowbitcc.codec import cpu, cuda, cuda_build
print(f"C++ codec: {cpu.load() is not None} ({time.perf_counter() - t:.0f} s)", flush=True)
print(f"C++ works: {works.wait() == 0} ({time.perf_counter() - t:.0f} s, beside it)", flush=True)
t = time.perf_counter()
try:  # every kernel instance in one NVRTC program; CuPy caches it on disk for the ranks after
    names = cuda_build.name_expressions()
    cuda.module().get_function(names[0])
    print(f"NVRTC: compiled {len(names)} kernels in {time.perf_counter() - t:.0f} s")
except Exception as exc:  # noqa: BLE001
    print(f"NVRTC: failed after {time.perf_counter() - t:.0f} s: {type(exc).__name__}: {exc}")
EOF
}

phase_frame() {  # the frame kernels, the poison word and the encode-cleared verdict,
    # encode_sum and decode_rows (fused launches), the place's call counter read and advanced on
    # the device, the 3-bit formats' calls: reference bytes, CUDA calls against CPU calls, one
    # launch against two
    x "${gpu_pytest[@]}" --timeout 120 \
        tests/codec/test_cuda_kernels.py tests/codec/test_encode_sum.py tests/codec/test_decode_rows.py \
        tests/codec/test_call_count.py \
        tests/gpu/test_cuda_backend.py -k "counter or address_word or read_and_count or encode_sum or decode_rows or frame_kernels or check_kernels or from_the_verdict or rows_themselves or every_row_also_past or frames_its_messages or fused_checksum or bitwise or poison_word or voids_its_states or equals_the_cpu_call_bit_for_bit or three_bit or dropped_on_the_host"
}

phase_plans() {  # call plans on CUDA, their host records and place renewals: bits
    x "${gpu_pytest[@]}" --timeout 150 tests/gpu/test_multirank.py \
        -k "call_plans or call_records or compressed_cuda_call_that_deviates or renewed or device_runner"
}

phase_graphs() {  # graph replay of a place (LOCO_CALL_GRAPHS=1): bits against the eager calls,
    # then planned_call_goals.py --graphs: host time per call, graphs against eager plans (each
    # call issued to an idle GPU; back to back, 2 ranks on one GPU time sockets)
    step 55 "${gpu_pytest[@]}" --timeout 120 tests/gpu/test_multirank.py -k "call_graphs"
    echo "--- planned_call_goals.py --graphs"
    x "$py" benchmarks/planned_call_goals.py --sizes 65536 1048576 --iters 50 --profiled 5 --graphs \
        --json "$out/graphs-goals.json"
}

phase_goals() {  # the goals per planned call: host us, launches, uploads, allocations,
    # against the exact call and NCCL's own, 2 ranks (16 Mi elements: GOALS_ARGS=)
    # shellcheck disable=SC2086  # GOALS_ARGS: words
    x "$py" benchmarks/planned_call_goals.py --host-profile 200 ${GOALS_ARGS---sizes 65536 1048576} \
        --json "$out/goals.json"
}

phase_hier() {  # the hierarchical schedule on NCCL node and rail groups, 2 nodes of 2
    x "${gpu_pytest[@]}" --timeout 180 tests/gpu/test_multirank.py -k "hierarchical"
}

phase_demo() {  # the README's demo on GPUs: DDP over loco beside DDP over nccl, 2 ranks
    x "$py" -m lowbitcc demo --steps 40 --link none
}

phase_train() {  # the end-to-end number: DDP over loco against DDP over nccl
    x "$py" -c "from lowbitcc.tools import netem
print('emulated links:', '; '.join(netem.missing_requirements()) or 'possible',
      '| kernel netem qdisc:', netem.kernel_netem_available())"
    local share=50 dtype
    [ -z "${TRAIN_LINK:-}" ] || share=33
    for dtype in fp32 bf16; do
        step $share "$py" -m lowbitcc bench-train --device cuda --np 2 --dtype $dtype \
            --schemes nccl loco --steps 30 --json "$out/train-$dtype.json"
    done
    if [ -n "${TRAIN_LINK:-}" ]; then  # e.g. TRAIN_LINK=10gbit (root, ip, tc)
        x "$py" -m lowbitcc bench-train --device cuda --np 2 --schemes nccl loco \
            --steps 20 --link "$TRAIN_LINK" --json "$out/train-link.json"
    fi
}

phase_places() {  # exact places, deviations seen on the GPU, the watchdog (2 and 4 ranks)
    x "${gpu_pytest[@]}" --timeout 200 tests/gpu/test_multirank.py \
        -k "exact_cuda or deviates_on_one_rank or stalled_peer"
}

phase_exactperf() {  # an exact 1 MiB all-reduce through loco against NCCL's own, 2 ranks
    x "$py" -m lowbitcc perf all_reduce --device cuda --np 2 --backend loco-exact nccl \
        -b 1M -e 1M -n 100 -w 20 --json "$out/exactperf.json"
}

phase_selftest() {
    x "$py" -m lowbitcc selftest --ranks 4 --cases "${CASES:-400}"
}

phase_pytest() {  # -v: each outcome is named as it comes, also where the phase is cut
    x "${gpu_pytest[@]}" --timeout 240 --durations 12
}

phase_unfixed() {  # the state-lifetime test without ErrorState.record_stream
    x env LOWBITCC_REQUIRE_GPU=1 "$py" - <<'EOF'
import pytest
from lowbitcc.codec import error_state
error_state.ErrorState.record_stream = lambda self, stream: None
code = pytest.main(["-m", "gpu", "-v", "-p", "no:cacheprovider", "-k", "outlives",
                    "tests/gpu/test_cuda_backend.py"])
print("without record_stream the test", "failed" if code == 1 else f"exited {code}")
EOF
}

phase_schedule() {
    x "${gpu_pytest[@]}" --timeout 200 tests/gpu/test_multirank.py
}

phase_launches() {
    x "$py" benchmarks/cuda_launches.py --names
}

phase_perf() {
    step 50 "$py" -m lowbitcc perf all_reduce --device cuda --np 1 \
        --backend loco4 loco-model nccl -b 256K -e 64M -f 4 -n 50 -w 10 --json "$out/perf-np1.json"
    x "$py" -m lowbitcc perf all_reduce --device cuda --np 2 \
        --backend loco4 loco-model nccl -b 256K -e 64M -f 4 -n 50 -w 10 --json "$out/perf-np2.json"
}

phase_codec() {  # the codec's goal: encode and decode at >= 0.5x of a copy from 16 MiB
    x "$py" -m lowbitcc codec-bench --device cuda -b "${CODEC_MIN:-1M}" -e 256M -f 4 \
        --min-time 0.2 --formats mxfp4 nvfp4 int --json "$out/codec.json"
}

if [ "${1:-}" = --phase ]; then  # the child that runs one phase (its stdout: the phase's log)
    "phase_$2"
    rc=$?
    if [ "$dry" = 1 ]; then
        [ $missing = 0 ] || exit 3
        if [ -n "${GPU_SUITE_DRY_SLEEP:-}" ]; then
            trap '' TERM
            sleep "$GPU_SUITE_DRY_SLEEP"
        fi
        exec "$py" "$report" stub "$2" "$out"
    fi
    exit $rc
fi

# -- the plan ------------------------------------------------------------------------------------

declare -A planned=()
phases_all=()
while read -r name secs _; do
    phases_all+=("$name")
    override=${name^^}_S
    planned[$name]=${!override:-$secs}
done < <(sed -n 's/^#| *//p' "$self")

asked=()
for arg in "$@"; do
    case $arg in
    -h | --help) usage; exit 0 ;;
    --dry) dry=1 ;;
    all) for name in "${phases_all[@]:1}"; do
            [[ " ${asked[*]} " == *" $name "* ]] || asked+=("$name")
         done ;;
    env) ;;  # always first
    *)  if [ -z "${planned[$arg]:-}" ]; then
            echo "gpu_suite: unknown phase '$arg' (phases: ${phases_all[*]}; --help)" >&2
            exit 2
        fi
        [[ " ${asked[*]} " == *" $arg "* ]] || asked+=("$arg") ;;
    esac
done
[ ${#asked[@]} -gt 0 ] || asked=(plans goals)
plan=(env "${asked[@]}")
deadline=${GPU_SUITE_DEADLINE_S:-540}
total=0 sum=""
for phase in "${plan[@]}"; do
    case ${planned[$phase]} in
    '' | *[!0-9]*) echo "gpu_suite: ${phase^^}_S=${planned[$phase]} is not whole seconds" >&2; exit 2 ;;
    esac
    total=$((total + planned[$phase]))
    sum+="${sum:+ + }$phase ${planned[$phase]}"
done
case $deadline in '' | *[!0-9]*) echo "gpu_suite: GPU_SUITE_DEADLINE_S=$deadline is not whole seconds" >&2; exit 2 ;; esac
if ((total > deadline)); then
    echo "gpu_suite: refused: the plan needs ${total}s ($sum) and the deadline is ${deadline}s" \
        "(GPU_SUITE_DEADLINE_S): ask for fewer phases or plan less (PHASE_S=N)" >&2
    exit 2
fi

# -- the run -------------------------------------------------------------------------------------

mkdir -p "$out" || exit 2
export GPU_SUITE_OUT_DIR=$out GPU_SUITE_DRY=$dry
tag=""
[ "$dry" != 1 ] || tag="dry, "
marker=$(mktemp)  # what this run wrote in $out is newer
summary=$out/summary.txt
now_ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((10#$t / 1000)); }
seconds() { printf '%d' $((($1 + 500) / 1000)); }
group=""
# the device tool brings back 8 files a call: on exit this run's logs and JSON go into one archive
pack() {
    [ -z "$group" ] || kill -KILL -- "-$group" 2>/dev/null
    local files
    mapfile -t files < <(cd "$out" && find . -maxdepth 1 -type f -newer "$marker" \
        ! -name summary.txt ! -name logs.tar.gz -printf '%P\n')
    # tar's status 1: a file changed while read (a rank still writing); the archive is made
    if [ ${#files[@]} -gt 0 ] &&
        { tar czf "$marker.tgz" --warning=no-file-changed -C "$out" "${files[@]}" || [ $? -eq 1 ]; }; then
        mv "$marker.tgz" "$out/logs.tar.gz" && (cd "$out" && rm -f -- "${files[@]}")
    fi
    rm -f "$marker" "$marker.tgz"
}
trap pack EXIT
trap 'exit 143' TERM INT

result() { echo "$1"; echo "$1" >>"$summary"; }
{
    echo "gpu_suite $(date -u '+%F %T') UTC, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')," \
        "deadline ${deadline}s, plan ${total}s: $sum$([ "$dry" = 1 ] && echo ', DRY (stand-ins, no GPU)')"
} | tee "$summary"
t0=$(now_ms)
passed=0 failed=0 skipped=0
for i in "${!plan[@]}"; do
    phase=${plan[$i]}
    need=$((planned[$phase] * 1000))
    left=$((deadline * 1000 - ($(now_ms) - t0)))
    if ((need > left)); then
        result "SKIP $phase (needs $((need / 1000))s, $(((left > 0 ? left : 0) / 1000))s left)"
        skipped=$((skipped + 1))
        continue
    fi
    rest=0  # the planned seconds of this phase and those after it
    for later in "${plan[@]:$i}"; do rest=$((rest + planned[$later] * 1000)); done
    share=$((left * need / rest))
    ((share >= need)) || share=$need
    grace=$((share / 10 < 10000 ? share / 10 : 10000))
    limit=$(printf '%d.%03d' $((share / 1000)) $((share % 1000)))
    started=$(now_ms)
    GPU_SUITE_SHARE_MS=$share timeout -k "$(printf '%d.%03d' $((grace / 1000)) $((grace % 1000)))" \
        "$limit" bash "$self" --phase "$phase" >"$out/$phase.log" 2>&1 </dev/null &
    group=$!  # timeout leads a process group of its own: what the phase left running goes with it
    wait $group 2>/dev/null  # (a phase killed after its grace: no "Killed" notice)
    rc=$?
    kill -KILL -- "-$group" 2>/dev/null
    group=""
    took=$(($(now_ms) - started))
    line=$("$py" "$report" verdict "$phase" "$out" "$rc" "$(seconds "$share")" 2>>"$out/$phase.log")
    case $line in
    "PASS $phase "* | "FAIL $phase "*) ;;
    *) line="FAIL $phase no verdict from $report (see $phase.log)" ;;
    esac
    result "$line (${tag}took $(seconds "$took")s of $(seconds "$share")s, planned $((need / 1000))s)"
    case $line in
    PASS*) passed=$((passed + 1)) ;;
    *)  failed=$((failed + 1))
        tail -n 4 "$out/$phase.log" | sed 's/^/    | /' ;;
    esac
done
echo "gpu_suite: $passed PASS, $failed FAIL, $skipped SKIP in $(seconds $(($(now_ms) - t0)))s of" \
    "${deadline}s; results in $summary, logs in $out/logs.tar.gz" | tee -a "$summary"
[ $((failed + skipped)) -eq 0 ]
