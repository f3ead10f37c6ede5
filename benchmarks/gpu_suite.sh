#!/usr/bin/env bash
# One lent GPU session's checks in order of value (docs/gpu.md, "Running the GPU suite"), each
# phase under its own time limit, every log in $OUT (the device tool's folder) or ./gpu-out.
#
#   benchmarks/gpu_session.sh [phase ...]     phases: frame plans graphs goals47 hier demo train
#                                             issue46 exactperf selftest pytest unfixed schedule
#                                             launches perf codec
#                                             (default: all; the environment is always printed)
#
# Phases that check a goal print one line "PASS <what> <number>" or "FAIL <what> <number>".
# Every log ends in $OUT/logs.tar.gz (the device tool returns at most 8 files).
#
# Runs with the machine's own python3 and packages (torch, CuPy, NCCL): lowbitcc is installed
# into it without dependencies; where that fails, PYTHONPATH serves (then `import lowbitcc`, not
# torch's autoload, registers "loco").
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# a rank still running 60 s after its group was made writes its threads' stacks to the log:
# what a hang waited on (tools/spawn.py)
export LOWBITCC_DUMP_STACKS_AFTER=${LOWBITCC_DUMP_STACKS_AFTER:-60}
# the device tool brings back 8 files a call: on exit every log goes into one archive
pack() {
    # tar's status 1: a file changed while read (a rank still writing); the archive is made
    { tar czf "/tmp/logs.tar.gz" --warning=no-file-changed -C "$out" . || [ $? -eq 1 ]; } &&
        find "$out" -maxdepth 1 -type f -delete && mv /tmp/logs.tar.gz "$out/logs.tar.gz"
}
trap pack EXIT
trap 'exit 143' TERM INT
py=python3
phases=${*:-frame plans graphs goals47 hier demo train issue46 exactperf selftest pytest unfixed schedule launches perf codec}

{
    date -u
    nvidia-smi -L
    $py -c 'import sys, torch, cupy, setuptools
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version(), "cupy", cupy.__version__, "setuptools", setuptools.__version__,
      "gpus", torch.cuda.device_count())'
    $py -m pip install -q --no-deps --no-build-isolation --no-index -e . ||
        { echo "pip install failed: using PYTHONPATH"; }
    $py -c 'import lowbitcc' || export PYTHONPATH=$PWD
    time $py -c 'from lowbitcc.codec import cpu; print("C++ codec:", cpu.load() is not None)'
} 2>&1 | tee "$out/env.txt"
$py -c 'import lowbitcc' 2>/dev/null || export PYTHONPATH=$PWD

# PASS/FAIL line of a pytest phase from its log: pass where something passed and nothing failed
verdict() {
    if grep -q " passed" "$2" && ! grep -qE " (failed|error)" "$2"; then
        echo "PASS $1 $(grep -E ' passed' "$2" | tail -1)"
    else
        echo "FAIL $1 $(grep -E 'passed|failed|error' "$2" | tail -1)"
    fi
}

for phase in $phases; do
    echo "=== $phase $(date -u +%T)"
    case $phase in
    frame)  # the frame kernels (written without a GPU, 8a6fda8+), the poison word and the
            # encode-cleared verdict (0de1013+), encode_sum and decode_rows (fused launches),
            # the place's call counter read and advanced on the device:
            # reference bytes, CUDA calls against CPU calls, one launch against two
        timeout "${FRAME_S:-150}" $py -m pytest -m gpu -q -p no:cacheprovider -rs --timeout 120 \
            tests/codec/test_cuda_kernels.py tests/codec/test_encode_sum.py tests/codec/test_decode_rows.py \
            tests/codec/test_call_count.py \
            tests/gpu/test_cuda_backend.py -k "counter or address_word or read_and_count or encode_sum or decode_rows or frame_kernels or check_kernels or from_the_verdict or rows_themselves or every_row_also_past or frames_its_messages or fused_checksum or bitwise or poison_word or voids_its_states or equals_the_cpu_call_bit_for_bit or dropped_on_the_host" \
            2>&1 | tee "$out/frame.txt"
        verdict frame "$out/frame.txt" ;;
    graphs)  # graph replay of a place (LOCO_CALL_GRAPHS=1): bits against the eager calls,
             # then issue47_goals with --graphs: host time per call, graphs against eager plans
             # (each call issued to an idle GPU; back to back, 2 ranks on one GPU time sockets)
        timeout "${GRAPHS_S:-150}" $py -m pytest -m gpu -v -p no:cacheprovider -rs --timeout 120 \
            tests/gpu/test_multirank.py -k "call_graphs" 2>&1 | tee "$out/graphs.txt"
        verdict graphs "$out/graphs.txt"
        timeout "${GRAPHS_AB_S:-120}" $py benchmarks/issue47_goals.py --sizes 65536 1048576 --iters 50 \
            --profiled 5 --graphs --json "$out/graphs-goals.json" 2>&1 | tee "$out/graphs-goals.txt" ;;
    plans)  # call plans on CUDA (83b502f+; first run 2026-11-27), their host records and place
            # renewals (unrun): bits
        timeout "${PLANS_S:-240}" $py -m pytest -m gpu -v -p no:cacheprovider -rs --timeout 150 \
            tests/gpu/test_multirank.py -k "call_plans or call_records or compressed_cuda_call_that_deviates or renewed" \
            2>&1 | tee "$out/plans.txt"
        verdict plans "$out/plans.txt" ;;  # host time: goals47 (plans against NCCL, same run)
    demo)  # the README's demo on GPUs: DDP over loco beside DDP over nccl, 2 ranks
        timeout 200 $py -m lowbitcc demo --steps 40 --link none 2>&1 | tee "$out/demo.txt"
        if grep -q "x nccl's speed" "$out/demo.txt"; then
            echo "PASS demo $(grep "x nccl's speed" "$out/demo.txt")"
        else
            echo "FAIL demo $(tail -1 "$out/demo.txt")"
        fi ;;
    train)  # issue 49's end-to-end number: DDP over loco against DDP over nccl, fp32 and bf16
        $py -c "from lowbitcc.tools import netem
print('emulated links:', '; '.join(netem.missing_requirements()) or 'possible',
      '| kernel netem qdisc:', netem.kernel_netem_available())" 2>&1 | tee "$out/train.txt"
        for dtype in fp32 bf16; do
            timeout "${TRAIN_S:-120}" $py -m lowbitcc bench-train --device cuda --np 2 --dtype $dtype \
                --schemes nccl loco --steps 30 --json "$out/train-$dtype.json"
        done 2>&1 | tee -a "$out/train.txt"
        if [ -n "${TRAIN_LINK:-}" ]; then  # e.g. TRAIN_LINK=10gbit (root, ip, tc)
            timeout 200 $py -m lowbitcc bench-train --device cuda --np 2 --schemes nccl loco \
                --steps 20 --link "$TRAIN_LINK" --json "$out/train-link.json" 2>&1 | tee -a "$out/train.txt"
        fi
        $py - "$out" <<'EOF' | tee -a "$out/train.txt"
import glob, json, math, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/train-*.json")):
    rows = {r["scheme"]: r for r in json.load(open(path))["rows"]}
    loco, nccl = rows["loco"], rows["nccl"]
    ok = all(math.isfinite(r["final_loss"]) for r in (loco, nccl))
    print(f"{'PASS' if ok else 'FAIL'} train {path.rsplit('/', 1)[1]} loco/nccl speed "
          f"{nccl['step_ms'] / loco['step_ms']:.2f}x, bytes {loco['bytes_per_step'] / nccl['bytes_per_step']:.3f}, "
          f"loss {loco['final_loss']:.4f} vs {nccl['final_loss']:.4f} (2 ranks sharing the GPU: timings of both)")
EOF
        ;;
    goals47)  # issue 47's goals: host us, launches, uploads, allocations per planned call,
              # against the exact call and NCCL's own, 2 ranks
        timeout "${GOALS47_S:-240}" $py benchmarks/issue47_goals.py --host-profile 200 ${GOALS47_ARGS:-} --json "$out/goals47.json" \
            2>&1 | tee "$out/goals47.txt" ;;
    hier)  # the hierarchical schedule on NCCL node and rail groups, 2 nodes of 2 (issue 49)
        timeout "${HIER_S:-200}" $py -m pytest -m gpu -v -p no:cacheprovider -rs --timeout 180 \
            tests/gpu/test_multirank.py -k "hierarchical" 2>&1 | tee "$out/hier.txt"
        verdict hier "$out/hier.txt" ;;
    selftest)
        timeout "${SELFTEST_S:-240}" $py -m lowbitcc selftest --ranks 4 --cases "${CASES:-400}" 2>&1 | tee "$out/selftest.txt" ;;
    pytest)
        # -v: each outcome is named as it comes, also where the phase is cut by its time limit
        timeout "${PYTEST_S:-420}" $py -m pytest -m gpu -v -p no:cacheprovider -rs --timeout 240 --durations 12 \
            -n 4 --dist loadfile 2>&1 | tee "$out/pytest-gpu.txt" ;;
    unfixed)  # the state-lifetime test without ErrorState.record_stream (it passed so on an H200)
        timeout 120 $py - 2>&1 <<'EOF' | tee "$out/unfixed.txt"
import sys
import pytest
from lowbitcc.codec import error_state
error_state.ErrorState.record_stream = lambda self, stream: None
code = pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", "-k", "outlives",
                    "tests/gpu/test_cuda_backend.py"])
print("without record_stream the test", "failed" if code == 1 else f"exited {code}")
EOF
        ;;
    issue46)  # exact places, deviations seen on the GPU, the watchdog (2 and 4 ranks)
        timeout "${ISSUE46_S:-300}" $py -m pytest -m gpu -v -p no:cacheprovider -rs --timeout 200 \
            tests/gpu/test_multirank.py -k "exact_cuda or deviates_on_one_rank or stalled_peer" \
            2>&1 | tee "$out/issue46.txt"
        verdict issue46 "$out/issue46.txt" ;;
    exactperf)  # an exact 1 MiB all-reduce through loco against NCCL's own, 2 ranks: <= 1.2x
        timeout 200 $py -m lowbitcc perf all_reduce --device cuda --np 2 --backend loco-exact nccl \
            -b 1M -e 1M -n 100 -w 20 --json "$out/exactperf.json" 2>&1 | tee "$out/exactperf.txt"
        $py - "$out/exactperf.json" <<'EOF' | tee -a "$out/exactperf.txt"
import json, sys
rows = {r["backend"]: r for r in json.load(open(sys.argv[1]))["rows"]}
loco, nccl = (rows[b]["in_place"]["time_us"] for b in ("loco-exact", "nccl"))
print(f"{'PASS' if loco <= 1.2 * nccl else 'FAIL'} exactperf loco-exact/nccl {loco / nccl:.3f} "
      f"({loco:.1f} vs {nccl:.1f} us, in place, 1 MiB, 2 ranks)")
EOF
        ;;
    schedule)
        timeout 240 $py -m pytest -m gpu -q -p no:cacheprovider -rs \
            --timeout 200 tests/gpu/test_multirank.py 2>&1 | tee "$out/pytest-schedule.txt" ;;
    launches)
        timeout 150 $py benchmarks/cuda_launches.py --names 2>&1 | tee "$out/launches.txt" ;;
    perf)
        for np in 1 2; do
            timeout 150 $py -m lowbitcc perf all_reduce --device cuda --np $np \
                --backend loco4 loco-model nccl -b 256K -e 64M -f 4 -n 50 -w 10 \
                --json "$out/perf-np$np.json"
        done 2>&1 | tee "$out/perf.txt" ;;
    codec)  # issue 47: encode and decode at >= 0.5x of a copy from 16 MiB (decodes of 8
            # elements a thread since 2026-11-27, never run on a GPU before this phase)
        timeout 150 $py -m lowbitcc codec-bench --device cuda -b "${CODEC_MIN:-1M}" -e 256M -f 4 --min-time 0.2 \
            --formats mxfp4 nvfp4 int --json "$out/codec.json" 2>&1 | tee "$out/codec.txt"
        $py - "$out/codec.json" <<'EOF' | tee -a "$out/codec.txt"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"]
        if r["impl"] == "cuda" and r["size_bytes"] >= 16 << 20]
for kind in ("encode", "decode"):  # the kernels' GPU time (issue 47's goal), then the whole call
    for on, copy in ((f"{kind}_device_GBps", "copy_device_GBps"), (f"{kind}_GBps", "copy_GBps")):
        worst = min(rows, key=lambda r: r[on] / r[copy])
        ratio = worst[on] / worst[copy]
        print(f"{'PASS' if ratio >= 0.5 else 'FAIL'} codec-{on.replace('_GBps', '')} {ratio:.3f}x of "
              f"copy at worst ({worst['format']}, {worst['size_bytes'] >> 20} MiB, {worst[on]:.0f} GB/s)")
EOF
        ;;
    *) echo "unknown phase $phase" ;;
    esac
done
echo "=== done $(date -u +%T)"
