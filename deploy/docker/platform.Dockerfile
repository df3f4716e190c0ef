# syntax=docker/dockerfile:1
# loraplex control plane (`loraplex serve`, `loraplex db upgrade`): CPU only.
# Build from the repository root:
#   docker build -f deploy/docker/platform.Dockerfile -t REGISTRY/loraplex/platform:0.1.0 .
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp

RUN groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin loraplex \
 && python -m venv /opt/venv

# The CPU build of torch, pinned as scripts/bootstrap.sh pins it (PyPI's default Linux wheel is the CUDA build).
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

WORKDIR /app
# Dependencies in their own layer: source edits do not reinstall them.
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
# Editable on purpose: `loraplex db upgrade` finds alembic.ini and migrations/ beside the source tree.
# Bytecode is compiled now because the root filesystem is read-only at run time.
RUN pip install --no-deps -e . \
 && python -m compileall -q /app /opt/venv

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["loraplex"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
