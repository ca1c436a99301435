#!/usr/bin/env bash
# The paged-attention kernel (kvcm_kernels.paged_attention) and the example engine on it, on the
# GPU machine in one call. Needs the service wheels in .whl (../shared/gpu/fetch-wheels .whl
# httptools msgpack). Logs and JSON go to $OUT (or ./gpu-out). PHASES picks what runs, in this
# order (default: all):
#   suite        tests/gpu whole (every GPU test file)
#   step         bench/bench_cuda_step.py --profile (the whole decode step on CUDA, host included)
#   kernel       tests/gpu/test_paged_attention_gpu.py (kernel vs dense SDPA, engine vs generate)
#   micro        the kernels' device time (do_bench median) and host time per launch (pre-bound
#                and through Triton's dispatch)
#   bench        bench/bench_engine.py --device cuda: transformers' batched generate, the engine
#                in process on the kernel and on the gather, and the sidecar ways (BENCH_WAYS)
#   engine-gpu   tests/gpu/test_engine_gpu.py (CUDA manager and CUDA IPC sidecar, kernel on)
#   engine-cpu   tests/test_engine.py tests/test_paged_attention.py (the CPU path)
set -uo pipefail
out=${OUT:-gpu-out}
phases=${PHASES:-suite step micro bench engine-cpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/service:$PWD/client:$PWD/kernels:$PWD/examples/engine:$PWD/tests
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"
has() { [[ " $phases " == *" $1 "* ]]; }
summary=()
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || tail -5 "$out/build.log"
if has suite; then
  timeout "${SUITE_S:-420}" python3 -m pytest tests/gpu -p no:cacheprovider -q -ra -o addopts="" \
    --timeout=150 --durations=12 2>&1 | tee "$out/pytest-gpu.log" | grep -v "^\s*$" | tail -40
  summary+=("suite: $(tail -1 "$out/pytest-gpu.log")")
fi
if has step; then
  timeout "${STEP_S:-240}" python3 bench/bench_cuda_step.py --profile --json "$out/cuda-step.json" \
    2>&1 | tee "$out/cuda-step.log" | head -${STEP_LINES:-120}
fi
if has kernel; then
  timeout "${KERNEL_S:-300}" python3 -m pytest tests/gpu/test_paged_attention_gpu.py \
    -p no:cacheprovider -q -ra -s 2>&1 | tee "$out/pytest-paged.log" | grep -v "^\s*$" | tail -20
  summary+=("kernel: $(tail -1 "$out/pytest-paged.log")")
fi
if has micro; then
  timeout 120 python3 - <<'EOF' 2>&1 | tee "$out/kernel-micro.log"
import time, torch, triton
from kvcm_kernels import paged_attention as pa
from kvcm_kernels.paged_attention import paged_attention, step_meta, store_kv
dev, tpb, R, H, KVH, D, LAYERS = "cuda", 16, 16, 16, 8, 128, 16
pool = torch.randn(1024, LAYERS * 2, tpb, KVH, D, device=dev, dtype=torch.float16)
kc, vc = pool[:, 0], pool[:, 1]  # kvcm's slot-mode views: the page stride is a whole slot
table = torch.randperm(1023, device=dev)[: R * 40].reshape(R, 40).int() + 1
for hist, q in ((200, 1), (600, 1), (0, 128), (128, 128)):
    meta = step_meta(list(range(R)), [hist] * R, [q] * R, dev)
    host = table.cpu()
    slots = torch.tensor([int(host[i, p // tpb]) * tpb + p % tpb
                          for i in range(R) for p in range(hist, hist + q)], device=dev)
    query = torch.randn(R, H, q, D, device=dev, dtype=torch.float16)
    k = torch.randn(R, KVH, q, D, device=dev, dtype=torch.float16)
    att = lambda: paged_attention(query, kc, vc, table, meta, empty=0)
    st = lambda: store_kv(k, k, kc, vc, slots, meta)
    att(); st(); torch.cuda.synchronize()
    t_att, t_st = triton.testing.do_bench(att, return_mode="median"), triton.testing.do_bench(st, return_mode="median")
    n = 300
    host = {}
    for direct in (True, False):  # pre-bound launches, then Triton's own dispatch
        for launcher in pa._LAUNCHERS.values():
            launcher.direct = direct
        t = time.perf_counter()
        for _ in range(n): att()
        host_att = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n): st()
        host_st = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        host[direct] = (host_att * 1e6, host_st * 1e6)
    kv_bytes = 2 * R * (hist + q) * KVH * D * 2
    print(f"history {hist} + {q} new x {R} req: attention {t_att*1e3:.1f} us device "
          f"({kv_bytes / (t_att * 1e-3) / 1e12:.2f} TB/s of K+V), host/launch {host[True][0]:.1f} us "
          f"pre-bound, {host[False][0]:.1f} us Triton's dispatch; store {t_st*1e3:.1f} us device, "
          f"host/launch {host[True][1]:.1f} / {host[False][1]:.1f} us")
EOF
fi
if has bench; then
  for args in "" ${BENCH_EXTRA:-}; do
    args=${args//,/ }
    timeout "${BENCH_S:-300}" python3 bench/bench_engine.py --device cuda ${BENCH_COMPARE:---compare-gather} \
      --ways "${BENCH_WAYS:-in-process,channel}" $args --json "$out/engine-cuda${args// /}.json" \
      2>&1 | tee -a "$out/bench-engine-cuda.log" | grep -E "^(#|\|)"
  done
fi
if has engine-gpu; then
  timeout "${ENGINE_GPU_S:-300}" python3 -m pytest tests/gpu/test_engine_gpu.py -p no:cacheprovider \
    -q -ra 2>&1 | tee "$out/pytest-engine-gpu.log" | tail -6
  summary+=("engine-gpu: $(tail -1 "$out/pytest-engine-gpu.log")")
fi
if has engine-cpu; then
  n=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
  timeout "${ENGINE_CPU_S:-300}" python3 -m pytest tests/test_engine.py tests/test_paged_attention.py \
    -p no:cacheprovider -q -ra $n 2>&1 | tee "$out/pytest-engine-cpu.log" | tail -4
  summary+=("engine-cpu: $(tail -1 "$out/pytest-engine-cpu.log")")
fi
printf '%s\n' "${summary[@]}"
