# kvcm sidecar image: CUDA 12 (one major throughout: torch's cu129 build and its nvidia-*-cu12
# library wheels, cupy-cuda12x), `kvcm serve` as the entry point, run as uid 10001. The API
# listens on a Unix socket in /run/kvcm (share that directory with the inference server);
# probes and metrics (only) listen on TCP 9470. With no model flags it starts without a model
# and the engine registers its own (POST /v1/model, register_model): /readyz answers 503
# "no_model" until then, so the health check reads /livez.
#
#   docker build -t kvcm .
#   docker run --gpus '"device=0"' -v kvcm-run:/run/kvcm -p 9470:9470 kvcm --memory 60GiB
#   docker run ... kvcm --model-config /models/config.json --memory 60GiB   # a fixed model
#
# Pins: the tests' constraints.txt plus deploy/constraints-cuda12.txt (torch==2.13.0+cu129
# from the PyTorch index, the same version the tests pin; cupy-cuda12x). Needs an NVIDIA driver
# for CUDA 12 (R525 or newer through CUDA's minor-version compatibility, R575 or newer for
# 12.9 itself); the image carries no driver and no CUDA toolkit: the wheels bring the CUDA
# libraries, which CuPy 14 finds in site-packages.
#
# Two stages: the builder compiles kvcm's C core (kvcm._native) and installs everything into a
# venv; the final stage is the same slim Python base plus that venv, so no compiler and no
# second copy of the CUDA libraries (the old base, nvidia/cuda:12.8.1-runtime, carried its own
# beside the wheels').
#
# Size, estimated (not built here: no Docker engine on the machine that wrote this), in
# decimal GB as `docker images` shows it, from wheels unpacked or listed on PyPI:
#   CUDA 12 library wheels unpacked: cuBLAS 0.86, cuDNN 1.00, cuSPARSELt 0.34, cuFFT 0.29,
#     NVRTC 0.23, cuRAND 0.17, nvJitLink 0.10 (measured: 2.98); cuSOLVER, cuSPARSE, NCCL,
#     NVSHMEM (1.17 compressed on PyPI, times the 1.45-1.55 measured on the others: 1.7-1.8);
#     CUPTI, cudart, cuFile, cuda-bindings about 0.1                             4.8-4.9
#   CuPy 14.2 unpacked (measured)                                                    0.29
#   torch 2.13.0+cu129 without its C++ tests and headers (the cu129 wheel is not on PyPI:
#     its CPU part as installed here, 0.75, plus 0.5-0.9 for the CUDA part, from PyPI's
#     CUDA 13 wheel of the same version, 0.53 compressed, against its CPU wheel, 0.19)  1.1-1.5
#   numpy, sympy, FastAPI and the other pure-Python needs, with bytecode                0.27
#   python:3.11-slim-bookworm                                                         0.13
#   total                                                                    about 6.6-7.1 GB
# (about 3.8-4.2 GB compressed, the sum of the wheels' download sizes). Triton (0.72 unpacked,
# needed only by torch.compile, which kvcm does not use) is removed. The CUDA 12 library wheels
# are 1.0 GB larger compressed than the CUDA 13 ones, so this is no smaller than the 6.5 GB
# that an unpinned build (CUDA 13 wheels on the 12.8 runtime base) gave, but it is the smallest
# CUDA 12 image of this stack: pinning cu129 in the old one-stage file would add the runtime
# base's libraries, Triton and the tests on top.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc and the C library's headers build kvcm's C core (docs/native.md); the Python headers come
# with the base image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/kvcm
ENV PATH=/opt/kvcm/bin:$PATH

# The PyTorch index for torch's CUDA 12.9 build (and the nvidia wheels it pins that PyPI lacks);
# everything else comes from PyPI.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu129
WORKDIR /src
COPY constraints.txt ./
COPY deploy/constraints-cuda12.txt deploy/
# The large dependencies first, in a layer of their own: a change to kvcm's code rebuilds from
# the next step, without downloading 4 GB again.
RUN pip install -c constraints.txt -c deploy/constraints-cuda12.txt \
    --extra-index-url "$TORCH_INDEX" torch cupy-cuda12x

COPY pyproject.toml setup.py README.md ./
COPY service service
COPY client client
COPY kernels kernels
COPY examples/engine/kvcm_engine examples/engine/kvcm_engine
# kvcm-client (./client, its own distribution) in the same command: kvcm depends on it and it
# is not on PyPI. Then what kvcm does not run: Triton (torch.compile only) and torch's C++
# tests and headers.
RUN pip install -c constraints.txt -c deploy/constraints-cuda12.txt \
    --extra-index-url "$TORCH_INDEX" ./client ".[gpu]" \
    && python -c "from kvcm import native; assert native.available(), 'no C core'" \
    && pip uninstall -y triton \
    && torch_dir=$(python -c "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])") \
    && rm -rf "$torch_dir/test" "$torch_dir/include" "$torch_dir"/bin/test_*

FROM ${PYTHON_IMAGE}

# HOME and CUPY_CACHE_DIR: CuPy's import creates its kernel cache (~/.cupy/kernel_cache unless
# CUPY_CACHE_DIR says otherwise) and raises PermissionError where it cannot, so the user has a
# home and the cache a directory of its own, both its to write. NVIDIA_DRIVER_CAPABILITIES:
# the container toolkit mounts the driver's CUDA library only for "compute" (NVIDIA's CUDA
# images set it; this one does not start from them).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/kvcm/bin:$PATH \
    HOME=/home/kvcm \
    CUPY_CACHE_DIR=/var/cache/kvcm/cupy \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --system --gid 10001 kvcm \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvcm kvcm \
    && mkdir -p /run/kvcm /var/cache/kvcm/cupy \
    && chown -R 10001:10001 /run/kvcm /var/cache/kvcm
COPY --from=builder /opt/kvcm /opt/kvcm
# The venv runs without the builder's compiler, and torch is the CUDA 12 build.
RUN python -c "import torch, kvcm_kernels; from kvcm import native; assert native.available(); \
assert torch.version.cuda.startswith('12.'), torch.version.cuda"

# Numeric, so that Kubernetes' runAsNonRoot can check it (a user name it cannot).
USER 10001:10001
WORKDIR /run/kvcm

ENV KVCM_DEVICE=cuda:0 \
    KVCM_UDS=/run/kvcm/kvcm.sock \
    KVCM_METRICS_HOST=0.0.0.0 \
    KVCM_METRICS_PORT=9470
EXPOSE 9470

HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9470/livez', timeout=2)"]

ENTRYPOINT ["kvcm", "serve"]
