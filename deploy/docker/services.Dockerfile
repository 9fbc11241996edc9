# One image for all six services; the command picks the service:
#   docker run IMAGE python -m services.scheduler
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY sbx ./sbx
RUN pip install . && useradd --system --uid 10001 sbx
USER 10001
