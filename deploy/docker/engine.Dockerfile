# syntax=docker/dockerfile:1
# loraplex GPU engine (`loraplex engine serve`). torch's CUDA wheels bring the CUDA runtime libraries (CUDA 13.0 for
# torch 2.13 on PyPI); the base image adds the NVIDIA container environment and asks the node for a driver that
# runs CUDA 13.0 (>= 580). The driver itself comes from the node (NVIDIA device plugin / GPU operator).
# Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t REGISTRY/loraplex/engine:0.1.0 .
FROM nvidia/cuda:13.0.0-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TRITON_CACHE_DIR=/cache/triton

# Triton compiles its launcher at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin loraplex \
 && python3.12 -m venv /opt/venv

# torch pinned as scripts/bootstrap.sh pins it, here as PyPI's default Linux (CUDA) build. Its wheel pins the Triton
# it was built with (triton==3.7.1 for torch 2.13.0), which wins over the dev extra's CPU-interpreter pin (3.9.0).
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY setup.py README.md alembic.ini ./
COPY loraplex/ loraplex/
COPY engine/ engine/
COPY kernels/ kernels/
COPY platform/ platform/
COPY migrations/ migrations/
COPY tuning_configs/ tuning_configs/
RUN pip install --no-deps -e . \
 && python -m compileall -q /app /opt/venv

USER 10001:10001
EXPOSE 8100
# /health is 503 until the model is loaded: a long start period covers large checkpoints.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=4)"]
ENTRYPOINT ["loraplex"]
# The chart passes its own arguments; this default serves a model mounted at /models/model.
CMD ["engine", "serve", "--model", "/models/model", "--host", "0.0.0.0", "--port", "8100", "--enable-lora"]
