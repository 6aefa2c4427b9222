#!/usr/bin/env bash
# GPU smoke test of the trtllm target, run from the repository root, on either path:
#   engine (TensorRT-LLM 1.2.1): nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3
#   llmapi (TensorRT-LLM >= 1.3, LLM API / PyTorch backend): a newer -trtllm-python-py3 tag
# e.g.  docker run --rm --gpus all --shm-size=2g -v "$PWD:/work" -w /work \
#         nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3 bash scripts/gpu_smoke.sh
#
# It builds the demo checkpoint with `trtprompt build --target trtllm` (a TensorRT engine, or
# checkpoint + model.yaml for the LLM API), serves it (tensorrtllm backend, or TensorRT-LLM's
# llmapi model behind trtprompt's prompt edge), streams one request, sends shared-prefix
# requests whose prompt is longer than max_num_tokens (so they only run with chunked prefill),
# checks that blocks were reused (kv_cache_reused_blocks > 0 after the first; on the engine
# path also the nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused"} gauge), and
# prints a pass/fail summary. Exit code 0 only when every check passed.
#
# Settings (environment): TRTLLM_API (auto: llmapi where TensorRT-LLM >= 1.3 is installed, else
# engine), WORK_DIR (build/gpu-smoke), PROFILE (chat), DTYPE (float16), MAX_SEQ_LEN (4096: the
# demo checkpoint's positions), MAX_NUM_TOKENS (512: below the shared prompt's length),
# TP_SIZE (1), PP_SIZE (1), GRPC_PORT (8001), HTTP_PORT (8000), METRICS_PORT (8002),
# READY_TIMEOUT (900), SKIP_INSTALL (0: pip-install this checkout without touching the
# container's packages), TRTPROMPT_LLMAPI_MODEL_DIR (llmapi: the folder of TensorRT-LLM's
# all_models/llmapi/tensorrt_llm, where the container keeps it elsewhere than trtprompt looks).

set -euo pipefail

TRTLLM_API="${TRTLLM_API:-auto}"
WORK_DIR="${WORK_DIR:-build/gpu-smoke}"
PROFILE="${PROFILE:-chat}"
DTYPE="${DTYPE:-float16}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-4096}"
MAX_NUM_TOKENS="${MAX_NUM_TOKENS:-512}"
TP_SIZE="${TP_SIZE:-1}"
PP_SIZE="${PP_SIZE:-1}"
GRPC_PORT="${GRPC_PORT:-8001}"
HTTP_PORT="${HTTP_PORT:-8000}"
METRICS_PORT="${METRICS_PORT:-8002}"
READY_TIMEOUT="${READY_TIMEOUT:-900}"
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

check_settings() {
    case "$TRTLLM_API" in
        auto|engine|llmapi) ;;
        *) fail_now "settings" "TRTLLM_API must be auto, engine or llmapi, got '${TRTLLM_API}'" ;;
    esac
}

resolve_api() {  # auto: what `trtprompt build` would pick with the installed TensorRT-LLM
    if [[ "$TRTLLM_API" == "auto" ]]; then
        TRTLLM_API="$(python3 -c 'from trtprompt.targets.llmapi_build import default_trtllm_api as d; print(d())')" \
            || fail_now "trtllm api" "cannot tell which TensorRT-LLM path this container has"
    fi
    record "trtllm api" "PASS" "${TRTLLM_API}"
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
    trtprompt build "$CKPT" -o "$ENGINE" --target trtllm --trtllm-api "$TRTLLM_API" --profile "$PROFILE" \
        --dtype "$DTYPE" --max-seq-len "$MAX_SEQ_LEN" --max-num-tokens "$MAX_NUM_TOKENS" \
        --enable-chunked-context --enable-kv-cache-reuse --tp-size "$TP_SIZE" --pp-size "$PP_SIZE" --force \
        --no-progress > "${WORK_DIR}/build.log" 2>&1 \
        || fail_now "trtllm build" "see ${WORK_DIR}/build.log: $(tail -n 1 "${WORK_DIR}/build.log")"
    end=$(date +%s)
    if [[ "$TRTLLM_API" == "llmapi" ]]; then
        check_model_yaml "$((end - start))"
        return
    fi
    local ranks
    ranks=$(find "$ENGINE" -maxdepth 1 -name 'rank*.engine' | wc -l)
    record "trtllm build" "PASS" "${ranks} rank file(s) in $((end - start)) s, profile ${PROFILE}"
}

check_model_yaml() {  # check_model_yaml SECONDS: the llmapi build's one model.yaml
    local out
    if out=$(python3 - "${ENGINE}/model.yaml" <<'PY'
import sys, yaml
args = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
kv = args.get("kv_cache_config") or {}
wrong = [k for k, ok in (("backend: pytorch", args.get("backend") == "pytorch"),
                         ("enable_chunked_prefill: true", args.get("enable_chunked_prefill") is True),
                         ("kv_cache_config.enable_block_reuse: true", kv.get("enable_block_reuse") is True)) if not ok]
if wrong:
    sys.exit("model.yaml lacks " + ", ".join(wrong))
print(f"max_seq_len {args['max_seq_len']}, max_num_tokens {args['max_num_tokens']}, reuse and chunked prefill on")
PY
    ); then
        record "llmapi build" "PASS" "${out} ($1 s, profile ${PROFILE})"
    else
        fail_now "llmapi build" "$out"
    fi
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
    local out code
    # Prints "<prompt tokens> <reused blocks per request>"; exit 3: a request failed (chunked prefill),
    # exit 4: no reuse after the first request.
    out=$(python3 - "$GRPC_PORT" "${ENGINE}/tokenizer" "$MAX_NUM_TOKENS" <<'PY'
import sys
from trtprompt.client import generate
from trtprompt.tokenizer import Tokenizer
url, max_num_tokens = f"127.0.0.1:{sys.argv[1]}", int(sys.argv[3])
# ~1,000 tokens shared: many full KV blocks of any shipped tokens_per_block, and more than
# max_num_tokens, so each prompt runs only if its prefill is chunked.
prefix = "System: you answer questions about the manual below.\n" + " ".join(
    f"Section {i}: the valve V{i} opens at {i * 7 % 101} kPa and closes at {i * 3 % 89} kPa." for i in range(60))
prompts = [f"{prefix}\nQuestion: {q}\nAnswer:" for q in
           ("Which valve opens first?", "Which valve closes last?", "Summarize section 5.")]
tokens = min(len(Tokenizer.from_dir(sys.argv[2]).encode(p)) for p in prompts)
reused = []
for prompt in prompts:
    r = generate(url, prompt, 8, stream=True, exclude_input_in_output=True, return_perf_metrics=True)
    if r.error:
        print(f"{tokens}-token prompt failed: {r.error}")
        sys.exit(3)
    reused.append(r.last("kv_cache_reused_blocks"))
print(tokens, " ".join(str(x) for x in reused))
if tokens <= max_num_tokens:
    print(f"prompt of {tokens} tokens does not exceed max_num_tokens {max_num_tokens}: raise the prefix")
    sys.exit(3)
if not all(isinstance(x, int) for x in reused[1:]) or min(reused[1:]) <= 0:
    sys.exit(4)
PY
    ) && code=0 || code=$?
    local tokens="${out%% *}" reused="${out#* }"
    case "$code" in
        0) record "chunked prefill" "PASS" "${tokens}-token prompts ran with max_num_tokens ${MAX_NUM_TOKENS}"
           record "kv_cache_reused_blocks" "PASS" "per request: ${reused}" ;;
        4) record "chunked prefill" "PASS" "${tokens}-token prompts ran with max_num_tokens ${MAX_NUM_TOKENS}"
           record "kv_cache_reused_blocks" "FAIL" "per request: ${reused} (expected > 0 after the first)" ;;
        *) record "chunked prefill" "FAIL" "$(printf '%s' "$out" | tail -n 1)" ;;
    esac
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
    check_settings
    check_environment
    install_trtprompt
    resolve_api
    build_engine
    if [[ "$TRTLLM_API" == "engine" ]]; then
        plain_engine_dir
    fi
    start_server
    stream_request
    shared_prefix_requests
    if [[ "$TRTLLM_API" == "engine" ]]; then  # the tensorrtllm backend's gauge; the llmapi model has its own
        reused_gauge
    fi
}

main "$@"
