#!/usr/bin/env bash
# Builds (or finds cached) the control-plane binaries; filled in by the local-control-plane work.
set -euo pipefail
echo "devcluster/build.sh: nothing to build yet"
