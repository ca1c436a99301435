#!/usr/bin/env bash
# The host tier on the GPU machine in one call: the copy benchmark (bandwidth, decode beside
# offloading, host hit against prefill), the copy kernel's tests against the CPU reference,
# then the randomized checksum run with the pools on cuda:0 (KVCM_GPU_HOST_CYCLES cycles,
# default 300000; 10^6 for the long run; KVCM_GPU_HOST_BENCH=0 skips the benchmark,
# KVCM_GPU_HOST_K selects checksum runs by pytest -k, e.g. "False-False" for the plain one).
# Needs the service wheels in .whl (../shared/gpu/fetch-wheels .whl httptools msgpack). Logs go to $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/service:$PWD/client:$PWD/kernels:$PWD/examples/engine
export PYTHONUNBUFFERED=1 KVCM_GPU_HOST_CYCLES=${KVCM_GPU_HOST_CYCLES:-300000}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if [ "${KVCM_GPU_HOST_BENCH:-1}" != 0 ]; then
  python3 bench/bench_host_tier.py --device cuda 2>&1 | tee "$out/bench-host-tier.log"
fi
python3 -m pytest tests/gpu/test_tier_copies_gpu.py -p no:cacheprovider -q -ra 2>&1 \
  | tee "$out/pytest-tier-copies.log" | tail -8
start=$(date +%s)
python3 -m pytest tests/gpu/test_host_tier_gpu.py -p no:cacheprovider -q -ra -s \
  ${KVCM_GPU_HOST_K:+-k "$KVCM_GPU_HOST_K"} \
  2>&1 | tee "$out/pytest-host-tier.log" | tail -8
echo "cycles=$KVCM_GPU_HOST_CYCLES seconds=$(( $(date +%s) - start ))"
