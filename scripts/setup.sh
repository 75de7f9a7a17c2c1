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
