# syntax=docker/dockerfile:1
# vit-serve gateway image. Two targets:
#   docker build -t vit-serve .                      # CPU (the default, last stage): torch CPU + onnxruntime
#   docker build --target cuda -t vit-serve:cuda .   # CUDA 12: torch CUDA, onnxruntime-gpu, TensorRT, torchvision
#                                                    # (nvJPEG decode of uploads: the server logs "decode: nvJPEG")
#   docker run -p 8000:8000 -v $PWD/runs/quickstart/exports:/models vit-serve /models/digits_32.onnx
# In production (a repository of models, API keys, TLS, Redis for explain-by-id across replicas, gRPC):
#   docker run -p 8000:8000 -p 8001:8001 -v $PWD/model_repository:/models:ro -v $PWD/secrets:/run/secrets:ro \
#     -e VIT_SERVE_API_KEYS_FILE=/run/secrets/api_keys -e VIT_SERVE_ADMIN_API_KEYS_FILE=/run/secrets/admin_keys \
#     -e VIT_SERVE_SSL_CERTFILE=/run/secrets/tls.crt -e VIT_SERVE_SSL_KEYFILE=/run/secrets/tls.key \
#     -e VIT_SERVE_STORE=redis://redis:6379/0 -e VIT_SERVE_GRPC_PORT=8001 -e VIT_SERVE_MODEL_CONTROL=poll vit-serve
# The install steps are the README's: a virtual environment, then `pip install ".[extras]"`.

ARG PYTHON_VERSION=3.11

# ---- build (CPU): the project and its serving extras in /opt/venv -------------------------------------
FROM python:${PYTHON_VERSION}-slim AS build-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY vit_serve ./vit_serve
COPY export ./export
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu "torch<=2.14.1" \
 && /opt/venv/bin/pip install ".[serve,export,triton]"

# ---- build (CUDA) -------------------------------------------------------------------------------------
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS build-cuda
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY vit_serve ./vit_serve
COPY export ./export
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install ".[serve,export,triton,tensorrt,cuda]" \
 && /opt/venv/bin/pip uninstall -y onnxruntime && /opt/venv/bin/pip install onnxruntime-gpu

# ---- runtime (CUDA) -----------------------------------------------------------------------------------
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 vit
COPY --from=build-cuda /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 VIT_SERVE_HOST=0.0.0.0 VIT_SERVE_PORT=8000
USER vit
WORKDIR /home/vit
EXPOSE 8000 8001
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python3", "-c", "import os, ssl, urllib.request; tls = bool(os.environ.get('VIT_SERVE_SSL_CERTFILE')); urllib.request.urlopen(('https' if tls else 'http') + '://127.0.0.1:8000/healthz', timeout=4, context=ssl._create_unverified_context() if tls else None)"]
ENTRYPOINT ["vit-serve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/models"]

# ---- runtime (CPU, default) ---------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS cpu
RUN useradd --create-home --uid 10001 vit
COPY --from=build-cpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
USER vit
WORKDIR /home/vit
EXPOSE 8000 8001
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, ssl, urllib.request; tls = bool(os.environ.get('VIT_SERVE_SSL_CERTFILE')); urllib.request.urlopen(('https' if tls else 'http') + '://127.0.0.1:8000/healthz', timeout=4, context=ssl._create_unverified_context() if tls else None)"]
ENTRYPOINT ["vit-serve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/models"]
