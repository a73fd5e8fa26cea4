#!/usr/bin/env bash
# A LOCAL STAND-IN for the images' base, `python:3.11-slim-bookworm`, for machines that cannot pull it
# (this one reaches Debian's and PyPI's mirrors but no image registry). Usage: standin-base.sh NAME
#
# What the official image gives our Dockerfiles, rebuilt from Debian bookworm's own packages with
# mmdebstrap: python3 3.11 with pip and venv, `python` and `pip` on PATH, pip allowed to install into
# the system interpreter (the official image's interpreter is not Debian's, so it has no PEP 668
# marker), useradd/groupadd, CA certificates, LANG=C.UTF-8. Not the same bytes: Debian's python3 lives
# in /usr (the official one in /usr/local) and pip installs into /usr/local/lib/python3.11/dist-packages.
#
# This machine reaches PyPI through a TLS-intercepting proxy, so the stand-in trusts the host's CA
# bundle (a `pip install` in a build would fail otherwise); an image built on it is for this machine.
#
# Cached by content: the image carries the sha256 of this script and of the host's CA bundle in its
# label `org.kubetune.standin`; an image of that name with the same label is reused.
set -euo pipefail
name="${1:?usage: standin-base.sh IMAGE-NAME (the Dockerfiles FROM)}"
ca_bundle=/etc/ssl/certs/ca-certificates.crt
packages=python3,python3-pip,python3-venv,ca-certificates,passwd
key="$(cat "$0" "$ca_bundle" | sha256sum | cut -c1-16)"

if [ "$(podman image inspect --format '{{index .Labels "org.kubetune.standin"}}' "$name" 2>/dev/null)" = "$key" ]; then
  echo "stand-in $name: cached ($key)"
  exit 0
fi

echo "stand-in $name: building from Debian bookworm ($packages)"
start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The hooks run with the new root as $1. Docs, man pages and apt's lists go, as in the slim images.
mmdebstrap --quiet --variant=minbase --include="$packages" \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
  --customize-hook='ln -sf /usr/bin/python3 "$1"/usr/local/bin/python' \
  --customize-hook='ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip' \
  --customize-hook="cp $ca_bundle \"\$1\"$ca_bundle" \
  --customize-hook='rm -rf "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/var/lib/apt/lists/*' \
  bookworm "$work/root.tar"
podman import --quiet \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --change "LABEL org.kubetune.standin=$key" \
  --change "LABEL org.kubetune.standin.for=$name" \
  "$work/root.tar" "$name" >/dev/null
echo "stand-in $name: built in $((SECONDS - start)) s ($(podman image inspect --format '{{.Size}}' "$name") bytes)"
