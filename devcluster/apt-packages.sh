#!/usr/bin/env bash
# Debian packages the local control plane needs (run by .ci/run before `make install`):
# Prometheus (the server only), openssl for the control plane's certificates, util-linux for
# `unshare` (each pod's private /etc/hosts and hostname), curl for the builder's tag checks.
set -euo pipefail
packages=(prometheus openssl util-linux curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "apt-packages: all present (${packages[*]})"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
# The Debian package would start a Prometheus listening on every interface; kubetune runs its
# own on loopback, so service starts are refused while installing.
policy=/usr/sbin/policy-rc.d
cleanup_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy"
  cleanup_policy=1
fi
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
[ "$cleanup_policy" -eq 0 ] || $sudo rm -f "$policy"
