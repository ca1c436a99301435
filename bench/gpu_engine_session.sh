#!/usr/bin/env bash
# The example engine on the GPU machine in one call: its GPU tests (CUDA manager and CUDA IPC
# sidecar against transformers' generate), then bench_engine.py on cuda. Needs the service
# wheels in .whl (../shared/gpu/fetch-wheels .whl httptools msgpack). Logs and JSON go to
# $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/service:$PWD/client:$PWD/kernels:$PWD/examples/engine
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest tests/gpu/test_engine_gpu.py tests/test_engine.py -p no:cacheprovider -q -ra \
  2>&1 | tee "$out/pytest-engine.log" | tail -15
python3 bench/bench_engine.py --device cuda --json "$out/engine-cuda.json" 2>&1 \
  | tee "$out/bench-engine-cuda.log" | tail -8
