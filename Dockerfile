# The kubetune operator image: `python -m kubetune_operator` (the Helm chart runs it).
# Build: `make images` (podman), or docker build -t ghcr.io/kubetune/operator:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# UID/GID 10001: above 10000, so no host account shares them (the chart's runAsUser).
RUN groupadd --gid 10001 kubetune && useradd --uid 10001 --gid 10001 --create-home kubetune

WORKDIR /src
# The dependencies in a layer of their own that only a change to pyproject.toml rebuilds, then this
# checkout without them: together the same install as `pip install ".[operator]"`. They are pinned in
# pyproject.toml, hence DL3013 is moot.
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator']))" > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY api ./api
COPY cli ./cli
COPY operator ./operator
COPY trainer_image/src ./trainer_image/src
COPY devcluster/src ./devcluster/src
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --no-deps .
USER 10001:10001
# As the operator's user: the operator's modules import (a missing dependency fails the build, not the pod).
RUN python -c "import kubetune_operator.__main__, kubetune_operator.handlers, kubetune_operator.sweeps"
ENTRYPOINT ["python", "-m", "kubetune_operator"]
