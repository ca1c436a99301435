#!/usr/bin/env bash
# Everything the GPU machine runs in one call: the whole test suite (tests/gpu included) and
# the kernel benchmarks. Needs the service wheels in .whl
# (../shared/gpu/fetch-wheels .whl httptools msgpack).
# Logs and JSON go to $OUT (or ./gpu-out). Left out there: test_fuzz (no schemathesis in the
# image) and test_client_dist (it pip-installs the client, and the machine has no index).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/service:$PWD/client:$PWD/kernels:$PWD/examples/engine PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, cupy, numpy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m pytest tests -p no:cacheprovider -q -ra --ignore=tests/test_fuzz.py --ignore=tests/test_client_dist.py 2>&1 | tee "$out/pytest.log" | tail -25
python3 bench/bench_kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/bench_kernels.log"
