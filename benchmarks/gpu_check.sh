#!/usr/bin/env bash
# The GPU check, as one command on a lent GPU machine (the device tool's `run`, carrying .gpu-wheels):
#   make gpu-wheels   # here, once: the wheels the GPU machine lacks (< 64 MiB)
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=480)
# It installs the carried wheels into a folder put before the machine's own packages (its torch with CUDA, onnx and
# onnxruntime stay in use), then runs benchmarks/gpu_check.py against the first CUDA device; the results land in
# $OUT/gpu_check.json. Arguments go to gpu_check.py (e.g. --quick, --device cuda:1); $PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python="${PYTHON:-python3}"
site="$(mktemp -d /tmp/sim2edge-gpu.XXXX)"
[ -d .gpu-wheels ] || { echo "gpu_check: no .gpu-wheels/ here; run 'make gpu-wheels' and carry it" >&2; exit 2; }
"$python" -m pip install -q --no-index --no-deps --find-links .gpu-wheels --target "$site" \
  -r benchmarks/gpu_requirements.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
PYTHONPATH="$PWD:$site" "$python" benchmarks/gpu_check.py --out "$out/gpu_check.json" "$@" 2>&1 \
  | grep -v -e "torchvision is not installed" -e "^Resolved observation sets" | tee "$out/gpu_check.log"
