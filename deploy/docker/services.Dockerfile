# One image for all six services; the command picks the service:
#   docker run IMAGE python -m services.scheduler
# Used by compose.yaml and by deploy/kubernetes (ghcr.io/cloud-agent-sandbox/services),
# where it runs as uid 10001 with a read-only root filesystem and /tmp as its only
# writable directory (SBX_STATE_DIR=/tmp/sbx).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY sbx ./sbx
COPY clients/python ./clients/python
RUN pip install "./clients/python[cli]" . && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent sbx
USER 10001
