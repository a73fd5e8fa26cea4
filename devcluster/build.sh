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
steps=10
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

# A scratch module that requires MODULE@VERSION, for modules whose version list the proxy refuses
# (sigs.k8s.io/kueue and sigs.k8s.io/jobset): `go install M@V` reads that list, `go build` in a
# module that names the version does not. The go line is the installed Go's, which is at least
# what any of these modules asks for.
scratch_module() {
  local module=$1 version=$2
  go mod init "kubetune.local/$(basename "$module")" >/dev/null 2>&1
  go mod edit -go="$(go env GOVERSION | sed 's/^go//')" -require="$module@$version"
}

# copy_from_module MODULE VERSION DEST FILE...: files of the module's zip (CRDs, webhook
# manifests) into DEST, writable (the module cache is read-only).
copy_from_module() {
  local module=$1 version=$2 dest=$3 src
  shift 3
  src="$(go env GOMODCACHE)/$(echo "$module" | sed 's/[A-Z]/!\L&/g')@$version"
  mkdir -p "$dest"
  for f in "$@"; do cp "$src/$f" "$dest/"; done
  chmod -R u+w "$dest"
}

# JobSet: its controller (the module's root package) plus its CRD and webhook configurations.
build_jobset() {
  local version=$1 dest=$2 mod=sigs.k8s.io/jobset
  scratch_module "$mod" "$version"
  echo "  go build $mod"
  go build -ldflags "-s -w -X $mod/pkg/version.GitVersion=$version" -o "$dest/bin/jobset" "$mod"
  copy_from_module "$mod" "$version" "$dest/config" \
    config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml config/components/webhook/manifests.yaml
}

# Kubeflow Trainer v2: go install works (its version list is served); CRDs and webhooks from
# manifests/base.
build_trainer() {
  local version=$1 dest=$2 mod=github.com/kubeflow/trainer/v2
  echo "  go install $mod/cmd/trainer-controller-manager@$version"
  GOBIN="$dest/bin" go install -ldflags "-s -w" "$mod/cmd/trainer-controller-manager@$version"
  copy_from_module "$mod" "$version" "$dest/config" \
    manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml \
    manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml \
    manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml manifests/base/webhook/manifests.yaml
}

# Kueue: the controller manager, its CRDs, its webhook configurations, and the kustomize patches
# that turn on conversion webhooks for the CRDs served in two versions (v1beta1 and v1beta2).
build_kueue() {
  local version=$1 dest=$2 mod=sigs.k8s.io/kueue src
  scratch_module "$mod" "$version"
  # Kueue's own go.sum pins its dependencies' hashes; the checksum database does not list some of
  # them (sigs.k8s.io/scheduler-library v0.1.0-alpha1), so they are verified against Kueue's pins.
  go mod download "$mod@$version"
  cat "$(go env GOMODCACHE)/$mod@$version/go.sum" >> go.sum
  echo "  go build $mod/cmd/kueue"
  go build -ldflags "-s -w -X $mod/pkg/version.GitVersion=$version" -o "$dest/bin/kueue" "$mod/cmd/kueue"
  src="$(go env GOMODCACHE)/$mod@$version/config/components"
  mkdir -p "$dest/config/crds" "$dest/config/crd-patches"
  cp "$src"/crd/bases/*.yaml "$dest/config/crds/"
  cp "$src"/crd/kustomization.yaml "$src"/crd/patches/webhook_in_*.yaml "$dest/config/crd-patches/"
  cp "$src"/webhook/manifests.yaml "$dest/config/"
  chmod -R u+w "$dest/config"
}

# Prometheus 3.x. remove_all_sd leaves out every service-discovery plugin but the built-in file
# and HTTP ones (the process kubelet writes file_sd targets): a third of the build, no cloud SDKs.
# Its UI assets are not embedded (no builtinassets tag); the API and /-/ready are all we use.
build_prometheus() {
  local version=$1 dest=$2 mod=github.com/prometheus/prometheus minor release
  minor="$(echo "$version" | cut -d. -f2)"   # v0.316.0 -> 316 -> Prometheus 3.16.0
  release="3.$((10#${minor:1})).$(echo "$version" | cut -d. -f3)"
  echo "  go install $mod/cmd/prometheus@$version (Prometheus $release)"
  GOBIN="$dest/bin" go install -tags remove_all_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" "$mod/cmd/prometheus@$version"
}

# kube-score, the Kubernetes manifest linter `make lint` runs (scripts/lint-manifests.sh). It
# stands in for kube-linter, whose module (golang.stackrox.io/kube-linter) the module proxy does not
# serve here; kube-score covers the same pod-level ground (security contexts, resources, probes,
# network policies, PodDisruptionBudgets), and checkov adds RBAC checks.
build_kube_score() {
  local version=$1 dest=$2 mod=github.com/zegl/kube-score
  echo "  go install $mod/cmd/kube-score@$version"
  GOBIN="$dest/bin" go install -ldflags "-s -w -X main.version=$version" "$mod/cmd/kube-score@$version"
}

build_component etcd "$ETCD_VERSION" build_etcd
build_component kubernetes "$KUBERNETES_VERSION" build_kubernetes
build_component helm "$HELM_VERSION" build_helm
build_component training-operator "$TRAINING_OPERATOR_VERSION" build_training_operator
build_component versitygw "$VERSITYGW_VERSION" build_versitygw
build_component prometheus "$PROMETHEUS_VERSION" build_prometheus
build_component jobset "$JOBSET_VERSION" build_jobset
build_component trainer "$TRAINER_VERSION" build_trainer
build_component kueue "$KUEUE_VERSION" build_kueue
build_component kube-score "$KUBE_SCORE_VERSION" build_kube_score
echo "control-plane binaries ready in $cache ($((SECONDS - total_start)) s)"
