# kvcm sidecar image: CUDA 12 runtime, kvcm with the `gpu` extra (cupy-cuda12x), `kvcm serve`
# as the entry point. The API listens on a Unix socket in /run/kvcm (share that directory with
# the inference server); probes and metrics (only) listen on TCP 9470. With no model flags it
# starts without a model and the engine registers its own (POST /v1/model, register_model):
# /readyz answers 503 "no_model" until then, so the health check reads /livez.
#
#   docker build -t kvcm .
#   docker run --gpus '"device=0"' -v kvcm-run:/run/kvcm -p 9470:9470 kvcm --memory 60GiB
#   docker run ... kvcm --model-config /models/config.json --memory 60GiB   # a fixed model
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kvcm
ENV PATH=/opt/kvcm/bin:$PATH

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY service service
COPY client client
COPY kernels kernels
COPY examples/engine/kvcm_engine examples/engine/kvcm_engine
# kvcm-client (./client, its own distribution) first: kvcm depends on it and it is not on PyPI.
# torch from PyPI is the CUDA 12 build (constraints.txt pins the CPU build for tests only).
# gcc and the Python headers build kvcm's C core (docs/native.md), then leave the image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && pip install ./client && pip install ".[gpu]" \
    && python -c "from kvcm import native; assert native.available(), 'no C core'" \
    && apt-get purge -y --auto-remove gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* /src

RUN useradd --system --uid 10001 --no-create-home kvcm \
    && mkdir -p /run/kvcm && chown kvcm /run/kvcm
USER kvcm
WORKDIR /run/kvcm

ENV KVCM_DEVICE=cuda:0 \
    KVCM_UDS=/run/kvcm/kvcm.sock \
    KVCM_METRICS_HOST=0.0.0.0 \
    KVCM_METRICS_PORT=9470
EXPOSE 9470

HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9470/livez', timeout=2)"]

ENTRYPOINT ["kvcm", "serve"]
