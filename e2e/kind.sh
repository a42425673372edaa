#!/usr/bin/env bash
# `make e2e-kind`: the same e2e suite on a kind cluster, for machines with Docker:
# create the cluster (e2e/kind.yaml: a control plane and two workers), build the three
# images, load them (and the daemon image under a second tag, which the upgrade scenario
# rolls to), and run the suite, which installs the chart with those images. The
# cluster is deleted at the end unless KEEP_CLUSTER=1. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CLUSTER=${KIND_CLUSTER:-weightcache-e2e}
TAG=${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/weightcache/Chart.yaml)}

missing=()
for tool in docker kind kubectl helm; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "make e2e-kind needs ${missing[*]} on PATH (Docker, https://kind.sigs.k8s.io, kubectl, helm);" \
       "without Docker, run \`make e2e\` (the test control plane)" >&2
  exit 2
fi
docker info > /dev/null 2>&1 || { echo "make e2e-kind: the Docker daemon does not answer (docker info)" >&2; exit 2; }

for image in daemon operator engine; do
  docker build -f "Dockerfile.$image" -t "weightcache-$image:$TAG" .
done
docker tag "weightcache-daemon:$TAG" "weightcache-daemon:$TAG-next"

kind create cluster --name "$CLUSTER" --config e2e/kind.yaml --wait 120s
kubeconfig=$(mktemp)
cleanup() {
  rm -f "$kubeconfig"
  [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$CLUSTER"
}
trap cleanup EXIT
kind get kubeconfig --name "$CLUSTER" > "$kubeconfig"
kind load docker-image --name "$CLUSTER" "weightcache-daemon:$TAG" "weightcache-daemon:$TAG-next" \
  "weightcache-operator:$TAG" "weightcache-engine:$TAG"

KUBECONFIG="$kubeconfig" WEIGHTCACHE_E2E_POD_HTTP=exec \
  WEIGHTCACHE_E2E_HELM_ARGS="--set image.tag=$TAG --set image.pullPolicy=Never" \
  WEIGHTCACHE_E2E_ENGINE_IMAGE="weightcache-engine:$TAG" \
  WEIGHTCACHE_E2E_NEXT_DAEMON_IMAGE="weightcache-daemon:$TAG-next" \
  "$PY" -m pytest e2e -p no:cacheprovider "$@"
