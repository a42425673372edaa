#!/usr/bin/env bash
# `make e2e`: the e2e suite against the test control plane of tests/cluster (as CI runs
# it): build or reuse its binaries, start a cluster, point KUBECONFIG (and PATH, for its
# kubectl and helm) at it, run the suite, and stop the cluster, also after a failure.
# Pod IPs of that cluster are loopback addresses, reachable from here (POD_HTTP=direct).
# Arguments go to pytest (e.g. `make e2e E2E_ARGS="-k upgrade -x"`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STATE=${E2E_CLUSTER_STATE:-/tmp/weightcache-e2e-cluster}
cluster() { PYTHONPATH="$PWD/tests" "$PY" -m cluster "$@"; }

bin_dir=$(cluster build)
kubeconfig=$(cluster up --state "$STATE")
trap 'cluster down --state "$STATE"' EXIT
started=$(date +%s)
KUBECONFIG="$kubeconfig" PATH="$bin_dir:$PATH" WEIGHTCACHE_E2E_POD_HTTP=direct \
  "$PY" -m pytest e2e -p no:cacheprovider "$@"
echo "e2e against the test control plane: $(( $(date +%s) - started )) s (cluster logs: $STATE/logs)" >&2
