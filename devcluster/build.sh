#!/usr/bin/env bash
# Builds the local control plane's binaries from the Go module proxy, one component at a time
# (CI has 2 cores), each into its own cache directory keyed by version:
#   ${KUBETUNE_CACHE:-~/.cache/kubetune}/<component>-<version>/bin/
# A directory with a `.done` marker is reused, so a warm machine skips every step.
# Versions come from devcluster/versions.env; kubetune_dev.versions reads the same file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

# The machines we run on install Go under /usr/local/go without always putting it on PATH.
command -v go >/dev/null || export PATH="/usr/local/go/bin:$PATH"
for tool in go curl; do
  command -v "$tool" >/dev/null || { echo "devcluster/build.sh: $tool is not installed (needed to build from the Go module proxy)" >&2; exit 1; }
done

cache="${KUBETUNE_CACHE:-$HOME/.cache/kubetune}"
# The installed Go only (no toolchain download); scratch modules resolve their graph on the fly.
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -trimpath" CGO_ENABLED=0
export GOPROXY="${GOPROXY:-https://proxy.golang.org}"
mkdir -p "$cache"

step=0
steps=5
total_start=$SECONDS

# build_component NAME VERSION FUNCTION: runs FUNCTION in a fresh scratch module unless cached.
build_component() {
  local name=$1 version=$2 fn=$3
  local dest="$cache/$name-$version"
  step=$((step + 1))
  if [ -f "$dest/.done" ]; then
    echo "[$step/$steps] $name $version: cached in $dest"
    return
  fi
  echo "[$step/$steps] $name $version: building into $dest"
  local start=$SECONDS work
  rm -rf "$dest" && mkdir -p "$dest/bin"
  work="$(mktemp -d)"
  (cd "$work" && "$fn" "$version" "$dest")
  rm -rf "$work"
  touch "$dest/.done"
  echo "[$step/$steps] $name $version: built in $((SECONDS - start)) s"
}

# Kubernetes publishes k8s.io/kubernetes with `replace k8s.io/X => ./staging/...`, which Go
# ignores in a dependency, so the scratch module repeats each replace with the staging module's
# own tag v0.<minor>.<patch>. Each such tag is checked first: some (k8s.io/externaljwt) were
# missing on some releases, and a clear message beats a resolver error.
build_kubernetes() {
  local version=$1 dest=$2 staging=v0.${1#v1.}
  go mod init kubetune.local/kubernetes >/dev/null 2>&1
  go mod edit -go=1.24.0 -require="k8s.io/kubernetes@$version"
  local mods
  mods="$(curl -fsS "$GOPROXY/k8s.io/kubernetes/@v/$version.mod" |
    awk '/^require/,/^\)/' | awk '$1 ~ /^k8s.io\// && $2 == "v0.0.0" {print $1}')"
  for mod in $mods; do
    curl -fsS -o /dev/null "$GOPROXY/$mod/@v/$staging.info" ||
      { echo "  $mod has no tag $staging on the module proxy" >&2; return 1; }
    go mod edit -replace="$mod=$mod@$staging"
  done
  # /version must report the real release: helm's kubeVersion check and the apiserver's
  # emulation-version logic both read it.
  local pkg=k8s.io/component-base/version ldflags="-s -w"
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1"
  ldflags+=" -X $pkg.gitMinor=$(echo "$version" | cut -d. -f2)"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$version"
  for cmd in kube-apiserver kube-controller-manager kubectl; do
    echo "  go build $cmd"
    go build -ldflags "$ldflags" -o "$dest/bin/$cmd" "k8s.io/kubernetes/cmd/$cmd"
  done
}

# etcd 3.6 has no main package in its server module: a two-line main calls etcdmain.Main,
# exactly what etcd's own root module does.
build_etcd() {
  local version=$1 dest=$2
  go mod init kubetune.local/etcd >/dev/null 2>&1
  go mod edit -go=1.23.0 -require="go.etcd.io/etcd/server/v3@$version"
  cat >main.go <<'EOF'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
  echo "  go build etcd"
  go build -ldflags "-s -w" -o "$dest/bin/etcd" .
}

build_helm() {
  local version=$1 dest=$2
  echo "  go install helm.sh/helm/v3/cmd/helm@$version"
  GOBIN="$dest/bin" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$version" \
    "helm.sh/helm/v3/cmd/helm@$version"
}

# The operator binary plus its CRDs, copied from the module (manifests/base/crds).
build_training_operator() {
  local version=$1 dest=$2 mod=github.com/kubeflow/training-operator
  echo "  go install $mod/cmd/training-operator.v1@$version"
  GOBIN="$dest/bin" go install -ldflags "-s -w" "$mod/cmd/training-operator.v1@$version"
  local src
  src="$(go env GOMODCACHE)/$mod@$version/manifests/base/crds"
  mkdir -p "$dest/crds" && cp "$src"/kubeflow.org_*.yaml "$dest/crds/" && chmod u+w "$dest/crds"/*.yaml
}

build_versitygw() {
  local version=$1 dest=$2
  echo "  go install github.com/versity/versitygw/cmd/versitygw@$version"
  GOBIN="$dest/bin" go install -ldflags "-s -w" "github.com/versity/versitygw/cmd/versitygw@$version"
}

build_component etcd "$ETCD_VERSION" build_etcd
build_component kubernetes "$KUBERNETES_VERSION" build_kubernetes
build_component helm "$HELM_VERSION" build_helm
build_component training-operator "$TRAINING_OPERATOR_VERSION" build_training_operator
build_component versitygw "$VERSITYGW_VERSION" build_versitygw
echo "control-plane binaries ready in $cache ($((SECONDS - total_start)) s)"
