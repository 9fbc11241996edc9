# The curated default sandbox image (SBX_K8S_IMAGES default=...): what an agent expects on
# a build machine. Build from the repository root:
#   docker build -t ghcr.io/cloud-agent-sandbox/sandbox:dev -f deploy/docker/sandbox.Dockerfile .
#
# The Kubernetes runtime decides who runs in it, not this file: uid 1000 (`sandbox`) for
# ordinary sandboxes, uid 0 with a few capabilities for run_as_root ones
# (shared/runtime/kubernetes/manifests.py). The pod's main process is the runtime's own
# hold loop (/bin/sh); commands arrive over exec, under bash when present.
#
# Proxy CA trust: with proxy egress the runtime mounts the proxies' CA certificate at
# /etc/sbx/ca/proxy-ca.pem (ConfigMap sbx-proxy-ca) and, when the sandbox starts, writes
# /etc/sbx/trust/ca-bundle.pem (the system store + that CA) into an in-memory volume.
# SSL_CERT_FILE, GIT_SSL_CAINFO, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, PIP_CERT and
# NODE_EXTRA_CA_CERTS point there. /etc/ssl/certs/ca-certificates.crt keeps its default
# mode (writable by root only): a root sandbox with a writable root gets the CA appended
# to it as well; nobody else can change the system store.
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        bash build-essential ca-certificates curl git jq less libcap2-bin nodejs npm \
        openssh-client procps python3 python3-pip python3-venv unzip util-linux \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 sandbox \
    && useradd --uid 1000 --gid 1000 --home-dir /workspace --no-create-home --shell /bin/bash sandbox \
    && install -d -o 1000 -g 1000 -m 0755 /workspace \
    && install -d -m 0755 /etc/sbx /etc/sbx/ca /etc/sbx/trust
# An expired credential makes git fail, never prompt (the runtime sets it too).
ENV GIT_TERMINAL_PROMPT=0 LANG=C.UTF-8
WORKDIR /workspace
USER 1000
CMD ["/bin/bash"]
