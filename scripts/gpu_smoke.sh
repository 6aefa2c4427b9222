#!/usr/bin/env bash
# GPU smoke test of the trtllm target, run from the repository root inside
#   nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3   (TensorRT-LLM 1.2.1)
# e.g.  docker run --rm --gpus all --shm-size=2g -v "$PWD:/work" -w /work \
#         nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3 bash scripts/gpu_smoke.sh
#
# It builds the demo checkpoint, compiles it with `trtprompt build --target trtllm`,
# serves it behind Triton's tensorrtllm backend, streams one request, sends
# shared-prefix requests, checks that blocks were reused (kv_cache_reused_blocks > 0
# and the nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused"} gauge),
# and prints a pass/fail summary. Exit code 0 only when every check passed.
#
# Settings (environment): WORK_DIR (build/gpu-smoke), PROFILE (chat), DTYPE (float16),
# MAX_SEQ_LEN (4096: the demo checkpoint's positions), TP_SIZE (1), PP_SIZE (1),
# GRPC_PORT (8001), HTTP_PORT (8000), METRICS_PORT (8002), READY_TIMEOUT (600),
# SKIP_INSTALL (0: pip-install this checkout without touching the container's packages).

set -euo pipefail

WORK_DIR="${WORK_DIR:-build/gpu-smoke}"
PROFILE="${PROFILE:-chat}"
DTYPE="${DTYPE:-float16}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-4096}"
TP_SIZE="${TP_SIZE:-1}"
PP_SIZE="${PP_SIZE:-1}"
GRPC_PORT="${GRPC_PORT:-8001}"
HTTP_PORT="${HTTP_PORT:-8000}"
METRICS_PORT="${METRICS_PORT:-8002}"
READY_TIMEOUT="${READY_TIMEOUT:-600}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"

CKPT="${WORK_DIR}/demo-checkpoint"
ENGINE="${WORK_DIR}/engine-trtllm"
RUN_DIR="${WORK_DIR}/run"
SERVE_LOG="${WORK_DIR}/serve.log"
SERVER_PID=""
declare -a RESULTS=()
FAILED=0

log() { printf '[gpu_smoke] %s\n' "$*" >&2; }

record() {  # record NAME STATUS DETAIL
    RESULTS+=("$(printf '%-28s %-4s %s' "$1" "$2" "$3")")
    if [[ "$2" != "PASS" ]]; then
        FAILED=1
    fi
}

summary() {
    printf '\n==== trtllm GPU smoke summary ====\n'
    local line
    for line in "${RESULTS[@]}"; do
        printf '%s\n' "$line"
    done
    if [[ "$FAILED" -eq 0 ]]; then
        printf 'RESULT: PASS\n'
    else
        printf 'RESULT: FAIL (logs: %s, %s)\n' "$SERVE_LOG" "$RUN_DIR"
    fi
}

stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}

finish() {
    local code=$?
    stop_server
    if [[ "${#RESULTS[@]}" -gt 0 ]]; then
        summary
    fi
    if [[ "$FAILED" -ne 0 && "$code" -eq 0 ]]; then
        code=1
    fi
    exit "$code"
}
trap finish EXIT

fail_now() {  # fail_now NAME DETAIL: a check the later ones depend on failed
    record "$1" "FAIL" "$2"
    exit 1
}

http_get() {  # http_get URL: print the body (python, so curl is not required)
    python3 - "$1" <<'PY'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
    sys.stdout.write(r.read().decode("utf-8", "replace"))
PY
}

check_environment() {
    command -v nvidia-smi >/dev/null || fail_now "nvidia-smi" "not found: run inside the trtllm container with --gpus"
    nvidia-smi -L >/dev/null || fail_now "nvidia-smi" "no GPU visible"
    record "gpu" "PASS" "$(nvidia-smi -L | head -n 1)"
    command -v tritonserver >/dev/null || fail_now "tritonserver" "not on PATH (wrong container?)"
    local version
    version="$(python3 -c 'import importlib.metadata as m; print(m.version("tensorrt_llm"))' 2>/dev/null)" \
        || fail_now "tensorrt_llm" "not installed (wrong container?)"
    record "tensorrt_llm" "PASS" "version ${version}"
}

install_trtprompt() {
    if [[ "$SKIP_INSTALL" == "1" ]]; then
        return
    fi
    # --no-deps: keep the container's torch/numpy/transformers; add only what is missing.
    python3 -m pip install --quiet --no-deps -e . || fail_now "install" "pip install -e . failed"
    local missing=()
    python3 -c 'import click' 2>/dev/null || missing+=("click>=8.1")
    python3 -c 'import tritonclient.grpc' 2>/dev/null || missing+=("tritonclient[grpc]")
    python3 -c 'import safetensors, tokenizers, tqdm' 2>/dev/null || missing+=(safetensors tokenizers tqdm)
    if [[ "${#missing[@]}" -gt 0 ]]; then
        python3 -m pip install --quiet "${missing[@]}" || fail_now "install" "pip install ${missing[*]} failed"
    fi
    record "install" "PASS" "trtprompt $(python3 -c 'import trtprompt; print(trtprompt.__version__)')"
}

build_engine() {
    mkdir -p "$WORK_DIR"
    if [[ ! -f "${CKPT}/config.json" ]]; then
        trtprompt demo-checkpoint "$CKPT" --size small >/dev/null \
            || fail_now "demo checkpoint" "trtprompt demo-checkpoint failed"
    fi
    record "demo checkpoint" "PASS" "$CKPT"
    local start end
    start=$(date +%s)
    trtprompt build "$CKPT" -o "$ENGINE" --target trtllm --profile "$PROFILE" --dtype "$DTYPE" \
        --max-seq-len "$MAX_SEQ_LEN" --tp-size "$TP_SIZE" --pp-size "$PP_SIZE" --force --no-progress \
        > "${WORK_DIR}/build.log" 2>&1 || fail_now "trtllm build" "see ${WORK_DIR}/build.log: $(tail -n 1 "${WORK_DIR}/build.log")"
    end=$(date +%s)
    local ranks
    ranks=$(find "$ENGINE" -maxdepth 1 -name 'rank*.engine' | wc -l)
    record "trtllm build" "PASS" "${ranks} rank file(s) in $((end - start)) s, profile ${PROFILE}"
}

plain_engine_dir() {  # the engine as plain trtllm-build leaves it: no trtprompt.json, tokenizer beside it
    local plain="${WORK_DIR}/plain-engine"
    rm -rf "$plain" && mkdir -p "$plain"
    cp "$ENGINE"/config.json "$ENGINE"/rank*.engine "$plain"/ && cp "$ENGINE"/tokenizer/* "$plain"/
    if ! trtprompt inspect "$plain" > "${WORK_DIR}/plain-inspect.log" 2>&1; then
        record "trtllm-build dir" "FAIL" "inspect: $(tail -n 1 "${WORK_DIR}/plain-inspect.log")"
    elif ! trtprompt serve "$plain" --repo-only "${WORK_DIR}/plain-repo" > "${WORK_DIR}/plain-repo.log" 2>&1; then
        record "trtllm-build dir" "FAIL" "serve --repo-only: $(tail -n 1 "${WORK_DIR}/plain-repo.log")"
    else
        record "trtllm-build dir" "PASS" "inspect and serve --repo-only on ${plain}"
    fi
}

start_server() {
    rm -rf "$RUN_DIR"
    trtprompt serve "$ENGINE" --run-dir "$RUN_DIR" --grpc-port "$GRPC_PORT" --http-port "$HTTP_PORT" \
        --metrics-port "$METRICS_PORT" --ready-timeout "$READY_TIMEOUT" > "$SERVE_LOG" 2>&1 &
    SERVER_PID=$!
    local waited=0
    until http_get "http://127.0.0.1:${HTTP_PORT}/v2/health/ready" >/dev/null 2>&1; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            fail_now "serve" "trtprompt serve exited: $(tail -n 3 "$SERVE_LOG" | tr '\n' ' ')"
        fi
        if [[ "$waited" -ge "$READY_TIMEOUT" ]]; then
            fail_now "serve" "not ready after ${READY_TIMEOUT} s (see $SERVE_LOG)"
        fi
        sleep 2
        waited=$((waited + 2))
    done
    record "serve" "PASS" "ready after ~${waited} s"
}

stream_request() {
    local out
    if out=$(python3 - "$GRPC_PORT" <<'PY'
import sys
from trtprompt.client import generate
pieces = []
r = generate(f"127.0.0.1:{sys.argv[1]}", "The quick brown fox", 16, stream=True,
             on_text=pieces.append, exclude_input_in_output=True)
if r.error or not r.text.strip():
    sys.exit(f"error={r.error!r} text={r.text!r}")
print(f"{len(r.responses)} responses, {len(r.text)} chars, TTFT {r.ttft_s * 1000:.1f} ms")
PY
    ); then
        record "stream" "PASS" "$out"
    else
        record "stream" "FAIL" "$out"
    fi
}

shared_prefix_requests() {
    local out
    if out=$(python3 - "$GRPC_PORT" <<'PY'
import sys
from trtprompt.client import generate
url = f"127.0.0.1:{sys.argv[1]}"
# ~1,000 tokens shared: many full KV blocks of any shipped tokens_per_block.
prefix = "System: you answer questions about the manual below.\n" + " ".join(
    f"Section {i}: the valve V{i} opens at {i * 7 % 101} kPa and closes at {i * 3 % 89} kPa." for i in range(60))
reused = []
for question in ("Which valve opens first?", "Which valve closes last?", "Summarize section 5."):
    r = generate(url, f"{prefix}\nQuestion: {question}\nAnswer:", 8, stream=True,
                 exclude_input_in_output=True, return_perf_metrics=True)
    if r.error:
        sys.exit(f"error: {r.error}")
    reused.append(r.last("kv_cache_reused_blocks"))
print(" ".join(str(x) for x in reused))
if not all(isinstance(x, int) for x in reused[1:]) or min(reused[1:]) <= 0:
    sys.exit(f"kv_cache_reused_blocks per request: {reused} (expected > 0 after the first)")
PY
    ); then
        record "kv_cache_reused_blocks" "PASS" "per request: ${out}"
    else
        record "kv_cache_reused_blocks" "FAIL" "$out"
    fi
}

reused_gauge() {
    sleep 2  # the backend publishes statistics every stats_check_period_ms
    local metrics value
    metrics=$(http_get "http://127.0.0.1:${METRICS_PORT}/metrics") || { record "reused gauge" "FAIL" "no /metrics"; return; }
    value=$(printf '%s\n' "$metrics" \
        | awk '/^nv_trt_llm_kv_cache_block_metrics\{/ && /kv_cache_block_type="reused"/ {print $NF; exit}')
    if [[ -z "$value" ]]; then
        record "reused gauge" "FAIL" 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused"} missing'
    elif awk -v v="$value" 'BEGIN { exit !(v > 0) }'; then
        record "reused gauge" "PASS" "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"reused\"} = ${value}"
    else
        record "reused gauge" "FAIL" "value ${value}, expected > 0"
    fi
}

main() {
    check_environment
    install_trtprompt
    build_engine
    plain_engine_dir
    start_server
    stream_request
    shared_prefix_requests
    reused_gauge
}

main "$@"
