#!/usr/bin/env bash
# Builds (or reuses) the upstream control-plane binaries for the test tier:
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, helm.
#
# They land in a cache folder OUTSIDE the checkout, keyed by the pinned versions
# (read from the go.mod files beside this script) plus a digest of those files,
# so a fresh clone on the same machine (CI) reuses them and a version bump builds
# anew. A build goes into a temporary folder that is renamed into place only when
# every binary is there: a killed build never leaves a cache that looks complete.
#
# Usage: build.sh            build if needed; the last line printed is the bin dir
#        build.sh --bin-dir  print the bin dir this checkout expects; build nothing
#        build.sh --check    exit 0 when that bin dir is complete, 1 otherwise
#
# Environment:
#   WEIGHTCACHE_K8S_BIN    a bin dir to use as-is (nothing is built)
#   WEIGHTCACHE_K8S_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/weightcache)
#   WEIGHTCACHE_BUILD_JOBS parallel compile jobs (default 2: the machines have 2 cores)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GODIR="$HERE/go"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm)
# Bump when the build flags below change, so that old caches are not reused.
RECIPE=1

log() { printf '[cluster-build %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# Version of MODULE as pinned in go.mod file FILE (single-line or block require).
pinned() {
    awk -v m="$2" '($1 == m && $2 ~ /^v/) { print $2; exit } ($1 == "require" && $2 == m) { print $3; exit }' "$1"
}

K8S_VERSION="$(pinned "$GODIR/kubernetes/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(pinned "$GODIR/etcd/go.mod" go.etcd.io/etcd/server/v3)"
HELM_VERSION="$(pinned "$GODIR/helm/go.mod" helm.sh/helm/v3)"

digest() {
    (cd "$GODIR" && cat kubernetes/go.mod kubernetes/go.sum etcd/go.mod etcd/go.sum etcd/main.go \
        helm/go.mod helm/go.sum && echo "recipe=$RECIPE") | sha256sum | cut -c1-10
}

bin_dir() {
    if [[ -n "${WEIGHTCACHE_K8S_BIN:-}" ]]; then
        echo "$WEIGHTCACHE_K8S_BIN"
        return
    fi
    local root="${WEIGHTCACHE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightcache}"
    echo "$root/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION-$(digest)/bin"
}

complete() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$1/$b" ]] || return 1; done
}

go_build() {  # go_build MODULE_DIR OUT_DIR LDFLAGS PACKAGES...
    local mod="$1" out="$2" ldflags="$3"
    shift 3
    (cd "$GODIR/$mod" && GOFLAGS="-buildvcs=false -mod=readonly" CGO_ENABLED=0 \
        go build -p "${WEIGHTCACHE_BUILD_JOBS:-2}" -trimpath -ldflags "-s -w $ldflags" -o "$out/" "$@")
}

build_into() {  # build_into DIR: every binary, the slow part
    local out="$1" minor cv="k8s.io/component-base/version"
    minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
    local k8s_ldflags="-X $cv.gitVersion=$K8S_VERSION -X $cv.gitMajor=1 -X $cv.gitMinor=$minor"
    k8s_ldflags+=" -X $cv.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
    log "building etcd $ETCD_VERSION"
    go_build etcd "$out" "" .
    log "building helm $HELM_VERSION"
    go_build helm "$out" "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
        helm.sh/helm/v3/cmd/helm
    log "building kubernetes $K8S_VERSION (kube-apiserver kube-controller-manager kube-scheduler kubectl; the long part)"
    go_build kubernetes "$out" "$k8s_ldflags" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
}

main() {
    local dir
    dir="$(bin_dir)"
    case "${1:-}" in
        --bin-dir) echo "$dir"; return ;;
        --check) complete "$dir"; return ;;
        "") ;;
        *) echo "usage: $0 [--bin-dir|--check]" >&2; return 2 ;;
    esac
    if complete "$dir"; then
        log "cached: $dir"
        echo "$dir"
        return
    fi
    if [[ -n "${WEIGHTCACHE_K8S_BIN:-}" ]]; then
        log "WEIGHTCACHE_K8S_BIN=$dir lacks some of: ${BINARIES[*]}"
        return 1
    fi
    command -v go >/dev/null || { log "no 'go' on PATH: cannot build ${BINARIES[*]} into $dir"; return 1; }
    # The pins need Go >= 1.26. An older local Go may fetch the one approved newer
    # toolchain from the module proxy (the go.mod files themselves stay at 1.26).
    local go_minor
    go_minor="$(GOTOOLCHAIN=local go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')"
    if [[ "$go_minor" =~ ^[0-9]+$ ]] && ((go_minor < 26)); then
        export GOTOOLCHAIN=go1.27.3
        log "local $(GOTOOLCHAIN=local go env GOVERSION) is older than the pins need: using GOTOOLCHAIN=$GOTOOLCHAIN"
    fi
    local key_dir
    key_dir="$(dirname "$dir")"
    mkdir -p "$(dirname "$key_dir")"
    # One build per key at a time; a second caller waits and then reuses it.
    exec 9>"$key_dir.lock"
    if ! flock -n 9; then
        log "another build of $key_dir is running; waiting for it"
        flock 9
    fi
    if complete "$dir"; then
        log "cached (built meanwhile): $dir"
        echo "$dir"
        return
    fi
    local tmp="$key_dir.tmp.$$" start=$SECONDS
    rm -rf "$key_dir".tmp.*  # left by a killed build: we hold the lock, so none is live
    mkdir -p "$tmp/bin"
    trap "rm -rf '$tmp'" EXIT  # expanded now: a local is gone by the time EXIT runs
    log "cold build into $key_dir ($(go version | cut -d" " -f3), ${WEIGHTCACHE_BUILD_JOBS:-2} jobs)"
    build_into "$tmp/bin"
    complete "$tmp/bin" || { log "build finished without all of: ${BINARIES[*]}"; return 1; }
    printf 'k8s=%s\netcd=%s\nhelm=%s\ngo=%s\nbuild_seconds=%s\n' "$K8S_VERSION" "$ETCD_VERSION" \
        "$HELM_VERSION" "$(go env GOVERSION)" "$((SECONDS - start))" >"$tmp/VERSIONS"
    rm -rf "$key_dir"
    mv "$tmp" "$key_dir"   # the atomic step: the key dir appears only when complete
    trap - EXIT
    log "built in $((SECONDS - start)) s: $dir ($(du -sh "$key_dir" | cut -f1))"
    echo "$dir"
}

main "$@"
