#!/usr/bin/env bash
# Where chatkv's engine decode step spends its time on the device machine, in one bounded run
# (about 2 to 3 minutes on an H200): benchmarks/device_profile.py on a random model of
# SmolLM2-135M's architecture in bfloat16 (SDPA per call by backend, the step before/after the
# cuDNN-attention switch, host-device syncs, torch.profiler tables). Set up as benchmarks/device_run.sh
# does: carry `.whl` and `.bench-model` (`benchmarks/device_run.sh prepare` makes them). Output also
# in $OUT/device_profile.txt, the profiler's Chrome trace beside it.
#
# DEVICE_RUN_SMOKE=1: on the CPU with a tiny random model and small sizes (checks the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/chatkv-device-profile}
mkdir -p "$OUT"
SMOKE=${DEVICE_RUN_SMOKE:-0}
LIMIT=${DEVICE_PROFILE_LIMIT_S:-200}
MODELS=${DEVICE_RUN_MODELS:-/tmp/chatkv-models}
SITE=${DEVICE_RUN_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

main() {
    echo "chatkv device profile, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
    if compgen -G ".whl/*.whl" >/dev/null && [[ $SMOKE != 1 ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            || { echo "FAILED: installing .whl/"; return 1; }
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    local like=${DEVICE_PROFILE_LIKE:-.bench-model/smollm2-135m-instruct} model=$MODELS/smollm2-135m-random
    local device=cuda shape=() sizes=(--sessions 1 8 16 --steps 8) threads=()
    if [[ $SMOKE == 1 ]]; then
        device=cpu model=$MODELS/tiny-random threads=(--threads 1)
        shape=(--hidden-size 64 --layers 2 --heads 4 --kv-heads 2 --intermediate-size 128)
        sizes=(--sessions 1 2 --steps 2 --history-tokens 40)
    fi
    if [[ ! -f $like/config.json ]]; then
        echo "FAILED: $like/config.json is missing (carry .bench-model; benchmarks/device_run.sh prepare makes it)"
        return 1
    fi
    [[ -f $model/config.json ]] || timeout 60 "$PY" benchmarks/random_model.py --like "$like" --out "$model" \
        --dtype bfloat16 --device "$device" "${shape[@]}" || { echo "FAILED: random model"; return 1; }
    timeout -k 5 "$LIMIT" "$PY" benchmarks/device_profile.py --model "$model" --device "$device" --dtype bfloat16 \
        "${threads[@]}" "${sizes[@]}" --out "$OUT"
    local rc=$?
    ((rc == 124 || rc == 137)) && echo "TIMED OUT after ${LIMIT} s"
    echo "=== done in ${SECONDS} s (exit $rc)"
}

main 2>&1 | tee "$OUT/device_profile.txt"
