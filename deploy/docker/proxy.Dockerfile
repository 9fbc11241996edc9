# The credential proxy (mitmproxy 11 + the sbx addon). Build from the repository root:
#   docker build -t ghcr.io/cloud-agent-sandbox/proxy:dev -f deploy/docker/proxy.Dockerfile .
# Its own image because mitmproxy's pins cannot share an environment with the services.
#
# Runs as uid 10002. The CA lives in --confdir (/var/lib/sbx-proxy/ca): on Kubernetes it
# comes from the Secret sbx-proxy-ca (deploy/kubernetes/base/proxy.yaml); under compose a
# volume keeps the one created on first start. Make a CA without starting the proxy:
#   docker run --rm -v "$PWD/proxy-ca:/ca" --user "$(id -u)" IMAGE --init-ca --confdir /ca
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only the package itself (never a local proxy/.venv or build output).
COPY proxy/pyproject.toml ./proxy/
COPY proxy/sbx_proxy ./proxy/sbx_proxy
RUN pip install ./proxy \
    && rm -rf /src/proxy \
    && groupadd --system --gid 10002 sbx-proxy \
    && useradd --system --uid 10002 --gid 10002 --no-create-home --home-dir /nonexistent sbx-proxy \
    && install -d -o 10002 -g 10002 -m 0700 /var/lib/sbx-proxy /var/lib/sbx-proxy/ca \
    && install -d -m 0755 /etc/sbx-proxy
WORKDIR /var/lib/sbx-proxy
USER 10002
EXPOSE 3128
ENTRYPOINT ["sbx-proxy"]
CMD ["--listen-host", "0.0.0.0", "--listen-port", "3128", "--confdir", "/var/lib/sbx-proxy/ca"]
