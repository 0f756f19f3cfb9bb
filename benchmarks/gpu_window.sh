#!/usr/bin/env bash
# The GPU suite through a lent machine whose commands end after 10 minutes (the device tool): the suite runs
# detached on the device (setsid, so it outlives the call that started it) and each call waits for it up to
# WAIT_S seconds, then packs what is finished into $OUT/gpu-results.tgz. Call again within the machine's 30 s
# warm period, or a fresh machine starts without the run.
#
#   device run, carry [".whl"]:  bash benchmarks/gpu_window.sh start      # installs .whl, starts the suite, waits
#   device run (again, again):   bash benchmarks/gpu_window.sh wait       # waits, packs; "suite finished" at the end
#   here:  tar xzf <files_at>/gpu-results.tgz && make gpu-merge
#
# Tested by tests/test_gpu_window.py with SUITE_ARGS=--dry-run on CPU.
#
# SUITE_ARGS passes arguments to gpu_suite.py (default: the 20-minute budget). A run that is cut off keeps every
# part it finished: each call's tarball holds all of them so far.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=$(realpath -m "${RESULTS:-/tmp/kiln-gpu/gpu-results}")
WAIT_S=${WAIT_S:-540}  # a call may run 600 s: start-up checks, the .whl install and packing take the rest
PY=${PY:-python3}  # the device's python3 holds its CUDA torch and Triton
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the suite runs from elsewhere
OUT=${OUT:-$PWD/gpu-window-out}
mkdir -p "$OUT"

pack() {
    # one file back: the device tool returns at most 8 files, and the suite writes ~15
    [ -d "$RESULTS" ] && tar czf "$OUT/gpu-results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    echo "--- suite log, last lines:"
    tail -n 25 "$RESULTS/suite.log" 2>/dev/null
    ls "$RESULTS" 2>/dev/null | tr '\n' ' '
    echo
}

running() { [ -f "$RESULTS/suite.pid" ] && kill -0 "$(cat "$RESULTS/suite.pid")" 2>/dev/null; }

wait_for_suite() {
    local deadline=$((SECONDS + WAIT_S))
    while running && [ $SECONDS -lt $deadline ]; do sleep 5; done
    if running; then
        echo "suite still running after this call's ${WAIT_S} s: call 'wait' again within 30 s"
    elif [ -f "$RESULTS/summary.json" ]; then
        echo "suite finished:"; cat "$RESULTS/summary.json"; echo
    else
        echo "suite stopped without summary.json (crashed or killed): see the log"
    fi
    pack
}

case "${1:-}" in
start)
    if running; then echo "a suite is already running (pid $(cat "$RESULTS/suite.pid"))"; wait_for_suite; exit 0; fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
        triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" || exit 1
    SITE=/tmp/kiln-gpu/site
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl || echo "installing .whl failed: the fp8 part will record why it did not run"
    fi
    rm -rf "$RESULTS"; mkdir -p "$RESULTS"
    # The suite runs from a copy: the tool may sync the working tree again at the next call, under a running suite.
    REPO="$(dirname "$RESULTS")/repo"
    rm -rf "$REPO"; mkdir -p "$REPO"
    tar -cf - --exclude=./.venv --exclude=./.git --exclude=./.whl --exclude=./runs --exclude=./gpu-results \
        --exclude=./gpu-window-out . | tar -xf - -C "$REPO" || exit 1
    # shellcheck disable=SC2086
    (cd "$REPO" && PYTHONPATH="$REPO:$SITE" PYTHONUNBUFFERED=1 setsid nohup "$PY" benchmarks/gpu_suite.py \
        --out "$RESULTS" ${SUITE_ARGS:-} >"$RESULTS/suite.log" 2>&1 < /dev/null & echo $! >"$RESULTS/suite.pid")
    echo "suite started (pid $(cat "$RESULTS/suite.pid")) in a copy of the tree, $REPO; results in $RESULTS"
    wait_for_suite
    ;;
wait)
    [ -d "$RESULTS" ] || { echo "no suite run on this machine ($RESULTS missing): it was given back; start again"; exit 1; }
    wait_for_suite
    ;;
*)
    echo "usage: $0 start|wait   (env: SUITE_ARGS, WAIT_S, RESULTS, OUT, PY)" >&2
    exit 2
    ;;
esac
