#!/usr/bin/env bash
# Wheels of what tk needs beyond torch, onnx and onnxruntime, for a GPU machine without network
# (Python 3.12, x86-64): model-signing and pyopenssl with their dependencies, the versions of this
# project's setup (scripts/setup.sh) as resolved on 2026-12-04, and torchao for the int8 packages of
# scripts/cpu_goals.sh (OpenVINO's wheel, 59 MB, does not fit beside them: its candidates are skipped). Run where pip reaches a registry:
#   bash scripts/gpu_wheels.sh [DIR]        (default .whl)
# then on the GPU machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site:. PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail
DIR=${1:-.whl}
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" \
  model-signing==1.1.1 pyopenssl==26.4.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 sigstore==4.5.1 \
  platformdirs==4.14.9 tuf==7.0.1 securesystemslib==1.6.0 sigstore-rekor-types==0.0.18 pydantic==2.14.4 \
  typing-inspection==0.4.5 pydantic-core==2.50.5 annotated-types==0.8.0 sigstore-models==0.0.6 \
  rfc3161-client==1.0.9 rfc8785==0.1.4 pyjwt==2.15.1 id==1.6.1 in-toto-attestation==0.9.3 blake3==1.0.11 \
  asn1crypto==1.5.1 torchao==0.18.0
ls "$DIR"/*.whl | wc -l
