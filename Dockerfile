# The kubetune operator image: `python -m kubetune_operator` (the Helm chart runs it).
# Build: docker build -t ghcr.io/kubetune/operator:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY cli ./cli
COPY operator ./operator
COPY trainer_image/src ./trainer_image/src
COPY devcluster/src ./devcluster/src
# Installs this checkout: its dependencies are pinned in pyproject.toml, hence DL3013 is moot.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[operator]" \
 && groupadd --gid 10001 kubetune && useradd --uid 10001 --gid 10001 --create-home kubetune
# UID/GID 10001: above 10000, so no host account shares them (the chart's runAsUser).
USER 10001:10001
ENTRYPOINT ["python", "-m", "kubetune_operator"]
