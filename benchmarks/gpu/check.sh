#!/usr/bin/env bash
# slotserve's one prepared device check: on a bare, offline CUDA machine (16 cores, Python 3.12 with numpy, torch,
# transformers and httpx; nvcc, cmake, ninja), build the patched libllama and llama-server from the sources carried
# along, start slotserve with every layer offloaded, and measure it beside llama-server (docs/gpu.md, "The device
# check").  Nothing is downloaded there: everything travels from here in parts under 64 MiB.
#
#   benchmarks/gpu/check.sh prepare    here: fill .gpu/ (git-ignored): p1/ the patched, trimmed llama.cpp sources and
#                                      the model's first part; p2/ the model's rest and the Python wheels
#   benchmarks/gpu/check.sh device     there, once with .gpu/p1 (builds, ~5 min on 16 cores) and once more right after
#                                      with .gpu/p2 (runs, ~4 min); each call does what its parts allow, so a call that
#                                      carries both does both.  Writes $OUT/gpu-check.json and $OUT/gpu-check.md
#   benchmarks/gpu/check.sh --dry-run  print every step and the bytes each call carries; changes nothing; exits 0
#
# What runs: `slotserve check --n-gpu-layers 99`; benchmarks/bench_table.py with --n-gpu-layers 99 beside llama-server
# (one stream at 500 and 4,000 tokens with no / aggregated / full attention, four conversations of 2,000 tokens, a
# 2,000-token save and restore, and in process the attention against transformers' eager reference with flash
# attention on and off); benchmarks/bench_stream.py at 4,000 tokens with the worker's tensors through the shared
# region and through its socket; benchmarks/bench_capture.py (decode step time by attention format, in process, at
# 4,000 and 16,000 tokens); benchmarks/bench_save_stall.py (four streams while a fifth saves); the one-stream
# rows again with --capture-graph lean (the capture's nodes only on decodes that capture, against the default stable)
# and with --stream-window 64 (flow control 64 tokens ahead instead of 4);
# benchmarks/gpu/report.py joins them into one JSON and one markdown table.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
GPU=$ROOT/.gpu                      # the carried parts (here: written by prepare; there: what arrived)
WORK=${SLOTSERVE_GPU_WORK:-/root/slotserve-gpu}   # there: the build and the model, kept between the two calls
OUT=${OUT:-$WORK/out}                # there: what comes back (at most 8 files); the rest stays in $LOG
LOG=$WORK/logs
LCP=llama_cpp_python-0.3.36
PART=48M                            # model parts: under 64 MiB with the checkout beside them
# Python packages slotserve needs that the device image lacks (cp312 wheels; torch, numpy, httpx are there)
WHEELS="litestar litestar-htmx msgspec multipart polyfactory faker rich rich-click structlog redis zstandard uvicorn
  httptools websockets watchfiles python-dotenv sniffio prometheus-client xxhash http-sf jinja2 markupsafe gguf
  pyyaml click anyio h11 typing-extensions diskcache"

step() { printf '== %s\n' "$*"; }
bytes() { if [ -e "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }

dry_run() {
  local model sdist
  model=$(.venv/bin/python -c "from engine.model import default_model_path; print(default_model_path())" 2>/dev/null || echo "")
  step "prepare (here): python libllama/build.py --source (sdist checked against libllama/upstream.toml's SHA-256, patch applied)"
  step "prepare: trim the tree (no models/docs/tests, no other GPU backends) and pack it: .gpu/p1/src.tar.xz + SHA256SUMS"
  step "prepare: split the model into $PART parts: .gpu/p1/model.part.aa, .gpu/p2/model.part.a[b-]"
  step "prepare: download cp312 manylinux wheels into .gpu/p2/whl: $(echo $WHEELS | wc -w) packages"
  if [ -d "$GPU/p1" ]; then
    echo "   carried by call 1 (.gpu/p1): $(bytes "$GPU/p1") bytes"
    echo "   carried by call 2 (.gpu/p2): $(bytes "$GPU/p2") bytes"
  else
    echo "   not prepared yet; inputs: model $( [ -n "$model" ] && bytes "$model" || echo '?') bytes," \
         "llama-cpp-python sdist $(grep -o 'sha256 = "[0-9a-f]*"' libllama/upstream.toml | head -1) (76,589,250 bytes before trimming)"
  fi
  echo "   the checkout itself (tracked files): $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
  step "device call 1: verify .gpu/p1 against SHA256SUMS; untar into $WORK"
  step "device call 1: cmake -G Ninja \$(python3 libllama/build.py --cmake-args) -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON; build llama, llama-server (-j 16)"
  step "device call 1: llama_cpp/lib -> the build's bin/ (one libggml in the process)"
  step "device call 2: join the model; pip install --no-index --target /tmp/site .gpu/p2/whl/*.whl"
  step "device call 2: slotserve check --model M --n-gpu-layers 99 > $LOG/check.log"
  step "device call 2: benchmarks/bench_table.py --n-gpu-layers 99 --threads 16 --llama-server $WORK/build/bin/llama-server --growth 500,4000 --json $LOG/bench.json"
  step "device call 2: benchmarks/bench_stream.py --shm both --ctx 4000 (the shared region against the socket) > \$LOG/stream.log"
  step "device call 2: benchmarks/bench_capture.py --contexts 4000,16000 --modes none,full,aggregated,topk,sink (the formats selected on the GPU, in process) > \$LOG/capture.log"
  step "device call 2: benchmarks/bench_save_stall.py --tokens 2000 (four streams while a fifth saves) > \$LOG/stall.log"
  step "device call 2: benchmarks/bench_table.py --skip streams,big,inproc --capture-graph lean (one stream) > \$LOG/bench_lean.log"
  step "device call 2: benchmarks/bench_table.py --skip streams,big,inproc --slotserve-args '--stream-window 64' > \$LOG/bench_window.log"
  step "device call 2: benchmarks/gpu/report.py -> \$OUT/gpu-check.json, \$OUT/gpu-check.md (+ check.log, bench.log, server-logs.tgz)"
}

prepare() {
  local src model tmp
  gi=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$gi")"
  grep -qx '/.gpu/' "$gi" 2>/dev/null || echo '/.gpu/' >> "$gi"
  rm -rf "$GPU"; mkdir -p "$GPU/p1" "$GPU/p2/whl"
  tmp=$(mktemp -d)
  step "patched sources"
  src=$(.venv/bin/python libllama/build.py --source)
  cp -r "$src" "$tmp/$LCP"
  d=$tmp/$LCP/vendor/llama.cpp
  rm -rf "$tmp/$LCP/.git" "$d"/models "$d"/docs "$d"/benches "$d"/media "$d"/.git* "$d"/tests "$d"/examples/*/ 2>/dev/null || true
  mkdir -p "$d/examples"; cp -r "$src/vendor/llama.cpp/examples/CMakeLists.txt" "$d/examples/" 2>/dev/null || true
  rm -rf "$d"/ggml/src/ggml-{et,metal,hexagon,sycl,opencl,vulkan,cann,musa,zdnn,webgpu,openvino,rpc,blas,zendnn} 2>/dev/null || true
  tar cJf "$GPU/p1/src.tar.xz" -C "$tmp" "$LCP"
  step "model"
  model=$(.venv/bin/python -c "from engine.model import default_model_path; print(default_model_path())")
  split -b $PART "$model" "$tmp/model.part."
  mv "$tmp/model.part.aa" "$GPU/p1/"; mv "$tmp"/model.part.* "$GPU/p2/"
  (cd "$GPU" && sha256sum p1/* p2/model.part.* > SHA256SUMS && cp SHA256SUMS p1/ && cp SHA256SUMS p2/)
  step "wheels"
  for pk in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$GPU/p2/whl" "$pk" 2>&1 | grep -v '^WARNING: Location' || true
  done
  rm -rf "$tmp"
  echo "call 1 carries .gpu/p1: $(bytes "$GPU/p1") bytes; call 2 carries .gpu/p2: $(bytes "$GPU/p2") bytes"
}

build_there() {
  step "build: sources"
  mkdir -p "$WORK"
  (cd "$GPU" && sha256sum -c --quiet --ignore-missing p1/SHA256SUMS)
  tar xJf "$GPU/p1/src.tar.xz" -C "$WORK"
  cp "$GPU/p1/model.part.aa" "$WORK/"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | tee "$LOG/device.txt"
  local args
  args=$(python3 libllama/build.py --cmake-args)
  echo "cmake arguments: $args" | tee "$LOG/build.txt"
  SECONDS=0
  # shellcheck disable=SC2086  # the arguments are words
  cmake -S "$WORK/$LCP/vendor/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release $args \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF > "$LOG/cmake.log" 2>&1 || { tail -30 "$LOG/cmake.log"; exit 1; }
  cmake --build "$WORK/build" --target llama llama-server -j "$(nproc)" > "$LOG/build.log" 2>&1 || {
    grep -m1 -B2 -A12 'error' "$LOG/build.log" | tee "$OUT/build-error.txt"; exit 1; }
  echo "build_s=$SECONDS" | tee -a "$LOG/build.txt"
  cp "$LOG/build.txt" "$LOG/device.txt" "$OUT/"
  rm -rf "$WORK/$LCP/llama_cpp/lib"; ln -s "$WORK/build/bin" "$WORK/$LCP/llama_cpp/lib"
  touch "$WORK/.built"
}

run_there() {
  step "run: model and wheels"
  (cd "$GPU" && sha256sum -c --quiet --ignore-missing p2/SHA256SUMS)
  cat "$WORK/model.part.aa" "$GPU"/p2/model.part.* > "$WORK/model.gguf"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$GPU"/p2/whl/*.whl
  export PYTHONPATH=/tmp/site:$WORK/$LCP:$ROOT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  local M=$WORK/model.gguf rc=0
  step "run: slotserve check"
  SECONDS=0
  python3 -m orchestrator.cli check --model "$M" --n-gpu-layers 99 > "$LOG/check.log" 2>&1 || rc=$?
  echo "check_rc=$rc check_s=$SECONDS" | tee "$LOG/check.txt"
  step "run: bench_table beside llama-server"
  python3 benchmarks/bench_table.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" \
    --llama-server "$WORK/build/bin/llama-server" --prompts 500,4000 --stream-prompt 2000 --big 2000 \
    --growth 500,4000 --wait-idle 0 --keep-logs --json "$LOG/bench.json" > "$LOG/bench.log" 2>&1 || echo "bench_table rc=$?"
  # the servers' own logs (the worker's t_prefill_ms per request, llama-server's timings), not their slot files
  logs=$(sed -n 's/^logs in //p' "$LOG/bench.log" | tail -1)
  [ -n "$logs" ] && tar czf "$OUT/server-logs.tgz" -C "$logs" $(cd "$logs" && ls ./*.log) || true
  step "run: the worker's tensors through the shared region and through its socket, 4,000 tokens"
  python3 benchmarks/bench_stream.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" --ctx 4000 --n-ctx 4352 \
    --new 128 --reps 3 --shm both --ws-compression none --wait-idle 0 --retries 0 > "$LOG/stream.log" 2>&1 \
    || echo "bench_stream rc=$?"
  step "run: the capture's cost in process by attention format (topk and aggregated selected in the graph)"
  python3 benchmarks/bench_capture.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" --contexts 4000,16000 \
    --new 64 --reps 3 --modes none,full,aggregated,topk,sink > "$LOG/capture.log" 2>&1 || echo "bench_capture rc=$?"
  step "run: four conversations with full attention while a fifth saves a 2,000-token state"
  python3 benchmarks/bench_save_stall.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" --tokens 2000 --new 128 \
    --reps 3 --wait-idle 0 > "$LOG/stall.log" 2>&1 || echo "bench_save_stall rc=$?"
  step "run: one stream again with the capture's nodes only on decodes that capture (--capture-graph lean)"
  python3 benchmarks/bench_table.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" --capture-graph lean \
    --llama-server "$WORK/build/bin/llama-server" --prompts 500,4000 --skip streams,big,inproc --wait-idle 0 \
    --json "$LOG/bench_lean.json" > "$LOG/bench_lean.log" 2>&1 || echo "bench_table lean rc=$?"
  step "run: one stream again with a flow-control window of 64 tokens (--stream-window 64; default 4)"
  python3 benchmarks/bench_table.py --model "$M" --n-gpu-layers 99 --threads "$(nproc)" --slotserve-args "--stream-window 64" \
    --llama-server "$WORK/build/bin/llama-server" --prompts 500,4000 --skip streams,big,inproc --wait-idle 0 \
    --json "$LOG/bench_window.json" > "$LOG/bench_window.log" 2>&1 || echo "bench_table window rc=$?"
  python3 benchmarks/gpu/report.py "$LOG" --json "$OUT/gpu-check.json" > "$OUT/gpu-check.md"
  cp "$LOG/check.log" "$LOG/bench.log" "$LOG/stream.log" "$LOG/stall.log" "$LOG/bench_lean.log" "$OUT/"
  cat "$OUT/gpu-check.md"
}

case "${1:-}" in
  --dry-run) dry_run ;;
  prepare) prepare ;;
  device)
    mkdir -p "$OUT" "$LOG"
    [ -f "$GPU/p1/src.tar.xz" ] && [ ! -f "$WORK/.built" ] && build_there
    if [ -f "$WORK/.built" ] && compgen -G "$GPU/p2/model.part.*" > /dev/null; then run_there; fi
    [ -f "$WORK/.built" ] || { echo "nothing built: carry .gpu/p1 first" >&2; exit 1; } ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
