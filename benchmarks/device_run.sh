#!/usr/bin/env bash
# chatkv's speed benchmarks on a GPU machine, in one bounded run (about 6 minutes on an H200).
#
# For the workplace's device machine: a bare image with torch and transformers but none of chatkv's
# other dependencies, no Redis, no PostgreSQL and no network. What it needs travels with the checkout
# as ignored folders named in the run's `carry`:
#   .whl/          cp312 manylinux x86_64 wheels of the missing packages and of the transformers that
#                  pyproject.toml pins (installed with `pip install --target /tmp/site`);
#   .bench-model/  SmolLM2-135M-Instruct's config, generation config, tokenizer and chat template
#                  without its weights (the bundled package is too big to carry): the benchmarks run
#                  on random weights of that architecture and of a ~1B Llama of the same family
#                  (benchmarks/random_model.py); speed does not depend on the weights' values.
# `benchmarks/device_run.sh prepare` fills both here (needs pip, the registry and the bundled model).
#
# Runs, each under its own `timeout` and all under one budget (DEVICE_RUN_BUDGET_S, default 390 s:
# a step that no longer fits is skipped and says so), the most telling first: concurrency (135M with
# the latency checks), engine_step (135M), concurrency (1B), engine_step (1B), resume_ttft (135M:
# device/host/disk vs re-prefill; the Redis rows skip themselves), multiturn_ttft (135M),
# packed_attention (no model). Everything is also written to
# $OUT/device_log.txt (and each benchmark's figures as JSON beside it).
#
# DEVICE_RUN_SMOKE=1: the same commands on the CPU with a tiny random model and tiny sizes, to check
# the script itself on a machine without a GPU (PYTHON picks the interpreter, default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}

prepare() {
    # Here, on a development machine: the wheels and the model's non-weight files.
    local pip=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl)
    mkdir -p .whl .bench-model/smollm2-135m-instruct
    "$PY" -m pip download -q "${pip[@]}" transformers==5.24.0 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 \
        cryptography==50.0.2 cffi==2.1.1 pycparser==3.0 platformdirs==4.14.9 redis==8.2.0 hiredis==3.5.0 \
        regex==2026.11.19 || return
    local source
    source=$("$PY" -c 'from pathlib import Path; from sessions.model_source import converted_default_dir
print(converted_default_dir(Path(".cache/models")))') || return
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
        cp "$source/$f" .bench-model/smollm2-135m-instruct/
    done
    du -sh .whl .bench-model
}

if [[ ${1:-} == prepare ]]; then
    prepare
    exit
fi

OUT=${OUT:-/tmp/chatkv-device-run}
mkdir -p "$OUT"
LOG=$OUT/device_log.txt
SMOKE=${DEVICE_RUN_SMOKE:-0}
BUDGET=${DEVICE_RUN_BUDGET_S:-390}
MODELS=${DEVICE_RUN_MODELS:-/tmp/chatkv-models}
SITE=${DEVICE_RUN_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CHATKV_BENCH_MODEL_CACHE=$MODELS/cache

# step SECONDS LABEL COMMAND...: run COMMAND under `timeout`, at most SECONDS and what is left of the
# budget; a step with under 20 s left is skipped.
step() {
    local limit=$1 label=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    ((limit > left)) && limit=$left
    echo
    echo "=== $label (limit ${limit} s, ${SECONDS} s elapsed)"
    if ((limit < 20)); then
        echo "SKIPPED: the budget of ${BUDGET} s is spent"
        return
    fi
    local began=$SECONDS
    timeout -k 5 "$limit" "$@"
    local rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "TIMED OUT after $((SECONDS - began)) s: $label"
    elif ((rc != 0)); then
        echo "FAILED (exit $rc) after $((SECONDS - began)) s: $label"
    else
        echo "--- $label: $((SECONDS - began)) s"
    fi
}

main() {
    echo "chatkv device run, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            || { echo "FAILED: installing .whl/"; return 1; }
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c 'import sys, torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA available: {torch.cuda.is_available()}), transformers {transformers.__version__} from {transformers.__file__}")' \
        || return 1

    local like=.bench-model/smollm2-135m-instruct small=$MODELS/smollm2-135m-random big=$MODELS/llama-1b-random
    # bfloat16: what chatkv runs on a GPU by default (sessions/device_defaults.py). Torch's own
    # threads on the 16-core machine, one on a shared development machine.
    local device=cuda dtype=bfloat16 threads=()
    # Sizes: N sessions in concurrency / engine_step, history sizes in resume_ttft, the conversation
    # length in multiturn_ttft, steps and repeats. Each figure is a median of few runs: enough to read
    # ratios against the baseline of the same run, in the time one device call allows.
    local conc_small=(1 8 16 32) conc_big=(8 32) step_small=(1 8 16 32) step_big=(1 8 32)
    local new_tokens=64 steps=10 sizes=2000,4000 target=2000 reply=64 long=2000 busy=7 repeats=5
    local big_shape=(--hidden-size 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate-size 8192)
    if [[ $SMOKE == 1 ]]; then
        device=cpu threads=(--threads 1)
        conc_small=(1 2) conc_big=(2) step_small=(1 2) step_big=(2)
        new_tokens=8 steps=3 sizes=300 target=300 reply=8 long=200 busy=2 repeats=1
        big_shape=(--hidden-size 64 --layers 2 --heads 4 --kv-heads 2 --intermediate-size 128)
    fi
    if [[ ! -f $like/config.json ]]; then
        echo "FAILED: $like/config.json is missing (carry .bench-model; benchmarks/device_run.sh prepare makes it)"
        return 1
    fi
    local common=(--device "$device" --dtype "$dtype" "${threads[@]}")

    # The small model: SmolLM2-135M-Instruct's own shape (a tiny one in the smoke run).
    local small_shape=()
    [[ $SMOKE == 1 ]] && small_shape=(--hidden-size 64 --layers 2 --heads 4 --kv-heads 2 --intermediate-size 128)
    step 30 "random model, 135M" "$PY" benchmarks/random_model.py --like "$like" --out "$small" --dtype "$dtype" \
        --device "$device" "${small_shape[@]}"
    # The ~1B Llama (Llama-3.2-1B's layer shapes with SmolLM2's vocabulary): about 1.07B parameters.
    step 45 "random model, 1B" "$PY" benchmarks/random_model.py --like "$like" --out "$big" --dtype "$dtype" \
        --device "$device" "${big_shape[@]}"

    # --no-unbatched: the 'batching off' column prepares a second set of sessions and decodes N turns
    # one after another, the slowest part at N=32; the transformers batch is the baseline here.
    step 100 "concurrency, 135M" "$PY" benchmarks/concurrency.py "${common[@]}" --model "$small" \
        --sessions "${conc_small[@]}" --new-tokens "$new_tokens" --ignore-eos --no-unbatched --busy "$busy" \
        --long-prompt-tokens "$long" --json "$OUT/concurrency_135m.json"
    step 50 "engine_step, 135M" "$PY" benchmarks/engine_step.py "${common[@]}" --model "$small" \
        --sessions "${step_small[@]}" --steps "$steps"
    step 60 "concurrency, 1B (no latency checks)" "$PY" benchmarks/concurrency.py "${common[@]}" --model "$big" \
        --sessions "${conc_big[@]}" --new-tokens "$new_tokens" --ignore-eos --no-unbatched --no-latency \
        --json "$OUT/concurrency_1b.json"
    step 45 "engine_step, 1B" "$PY" benchmarks/engine_step.py "${common[@]}" --model "$big" \
        --sessions "${step_big[@]}" --steps "$steps"
    step 80 "resume_ttft, 135M" "$PY" benchmarks/resume_ttft.py "${common[@]}" --model "$small" \
        --sizes "$sizes" --repeats 1
    step 50 "multiturn_ttft, 135M" "$PY" benchmarks/multiturn_ttft.py "${common[@]}" --model "$small" \
        --target-tokens "$target" --max-new-tokens "$reply" --repeats 1
    step 30 "packed_attention (no model)" "$PY" benchmarks/packed_attention.py --device "$device" --dtype "$dtype" --repeats "$repeats"

    echo
    echo "=== done in ${SECONDS} s (budget ${BUDGET} s)"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
}

main 2>&1 | tee "$LOG"
