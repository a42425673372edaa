# Control-plane test tier (tests/cluster). Included by the top-level Makefile, which
# defines PY (the venv's python). Binaries are cached outside the checkout, keyed by
# the pinned versions: see tests/cluster/README.md.
CLUSTER_DIR ?= tests/cluster
CLUSTER_STATE ?= /tmp/weightcache-cluster
CLUSTER_PY = PYTHONPATH=$(CURDIR)/tests$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m cluster

.PHONY: cluster-build cluster-up cluster-down cluster-status

cluster-build: ## build (or reuse) kube-apiserver, controller-manager, scheduler, etcd, kubectl, helm
	@bash $(CLUSTER_DIR)/build.sh

cluster-up: ## (builds first if needed) start a test cluster in the background; prints its kubeconfig path
	@$(CLUSTER_PY) up --state $(CLUSTER_STATE)

cluster-down: ## stop the cluster that cluster-up started
	@$(CLUSTER_PY) down --state $(CLUSTER_STATE)

cluster-status:
	@$(CLUSTER_PY) status --state $(CLUSTER_STATE)
