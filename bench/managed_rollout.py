"""A rolling update of an 8-replica inference Deployment, with the cache and without, in
one run on the test control plane (real kube-apiserver, controller-manager and scheduler;
the node simulator runs the pods as local processes; cpu backend):

  cache   the Deployment uses a WeightCache and is annotated
          weightcache.io/managed-rollout: "true": each new pod attaches to the resident weights
  disk    the same Deployment without the cache: each new pod loads the model from disk
          (page cache warm: the model was just written and read)

Each trial changes the pod template (an annotation) and times from that patch to the
rollout complete: the controller observed the change, every replica is updated, Ready
and available, and no old pod is left. Both Deployments keep the default strategy
(maxSurge 25%, maxUnavailable 25%: two pods at a time for 8). The model is generated: a
BERT of about --gib GiB (float32, random weights; see clusterbench.write_big_model).

    .venv/bin/python bench/managed_rollout.py                         # 3 trials each, ~1 GiB
    .venv/bin/python bench/managed_rollout.py --trials 1 --gib 0.2    # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import urllib.request

from clusterbench import CACHE, MODEL, ROOT, cache_on_one_node, cpu_model, log, versions
from harness import print_table, write_report

from cluster import wait_for  # noqa: E402  (clusterbench put tests/ on the path)
from standbykit import ENGINE_PORT, Env, engine_deployment, is_ready  # noqa: E402

REPLICAS = 8


class Rollouts:
    def __init__(self, env: Env, node: str) -> None:
        from kubernetes import client

        self.env, self.node = env, node
        self.apps = client.AppsV1Api(env.cluster.api_client)

    def deploy(self, app: str, cache: str | None) -> None:
        manifest = engine_deployment(app, MODEL, cache, None, replicas=REPLICAS)
        manifest["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.node}
        if cache:
            manifest["metadata"]["labels"]["weightcache.io/cache"] = cache
            manifest["metadata"]["annotations"]["weightcache.io/managed-rollout"] = "true"
        self.env.apply(manifest)
        self.wait_complete(app, 900)

    def complete(self, app: str) -> bool:
        d = self.apps.read_namespaced_deployment(app, self.env.ns)
        s = d.status
        return (s.observed_generation or 0) >= d.metadata.generation and s.updated_replicas == REPLICAS \
            and s.ready_replicas == REPLICAS and s.available_replicas == REPLICAS and s.replicas == REPLICAS

    def wait_complete(self, app: str, timeout: float) -> float:
        wait_for(lambda: self.complete(app), timeout, f"{app} rolled out", interval=0.2)
        return time.monotonic()

    def trial(self, app: str, n: int) -> float:
        patch = {"spec": {"template": {"metadata": {"annotations": {"bench.weightcache.io/trial": str(n)}}}}}
        t0 = time.monotonic()
        self.apps.patch_namespaced_deployment(app, self.env.ns, patch)
        return (self.wait_complete(app, 1800) - t0) * 1e3

    def sources(self, app: str) -> dict:
        """How the engines got their weights and how long that took, from each one's /status."""
        counts: dict[str, int] = {}
        weights_ms = []
        for p in self.env.pods(f"app={app}"):
            if p["metadata"].get("deletionTimestamp") or not is_ready(p):
                continue
            url = f"http://{p['status']['podIP']}:{ENGINE_PORT}/status"
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
            counts[doc.get("source", "?")] = counts.get(doc.get("source", "?"), 0) + 1
            weights_ms.append(doc.get("load_ms") or doc.get("attach_ms") or 0.0)
        return {"engines_by_source": counts,
                "weights_ms_median": round(statistics.median(weights_ms), 1) if weights_ms else None}

    def remove(self, app: str) -> None:
        self.env.cluster.kubectl("delete", "deployment", app, "-n", self.env.ns, "--wait=true", "--timeout=180s",
                                 check=False, timeout=200)
        wait_for(lambda: not self.env.pods(f"app={app}"), 180, f"{app}'s pods gone", interval=0.5)


def summary(samples: list[float]) -> dict:
    return {"trials": len(samples), "median_ms": round(statistics.median(samples), 1),
            "min_ms": round(min(samples), 1), "max_ms": round(max(samples), 1),
            "samples_ms": [round(s, 1) for s in samples]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3, help="template changes per mode (default 3)")
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB (default 1)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)

    results, sources = {}, {}
    with cache_on_one_node("wcr", args.gib) as (env, node, model):
        rollouts = Rollouts(env, node)
        for mode, label, cache in (("cache", f"{REPLICAS} replicas, attach (managed)", CACHE),
                                   ("disk", f"{REPLICAS} replicas, load from disk", None)):
            app = f"r{mode}"
            log(f"{mode}: deploying {REPLICAS} replicas ...")
            rollouts.deploy(app, cache)
            samples = []
            for i in range(args.trials):
                samples.append(rollouts.trial(app, i + 1))
                log(f"  {mode}: {i + 1}/{args.trials}: {samples[-1] / 1e3:.1f} s")
            sources[mode] = rollouts.sources(app)
            log(f"  {mode}: engines' weight source after the last rollout: {sources[mode]}")
            rollouts.remove(app)
            results[mode] = {"label": label, **summary(samples)}

    print_table({r["label"]: r for r in results.values()}, results["cache"]["label"], "cache")
    report = {
        "benchmark": "managed_rollout",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "device": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
        "versions": versions(),
        "setup": {"cluster": "tests/cluster: kube-apiserver, kube-controller-manager, kube-scheduler, node simulator "
                             "(pods as local processes), one node",
                  "backend": "cpu", "model": model, "replicas": REPLICAS,
                  "strategy": "RollingUpdate, default maxSurge 25% / maxUnavailable 25%",
                  "measured": "template patch -> observedGeneration current, updated = ready = available = replicas, "
                              "no old pod left (polled every 0.2 s)",
                  "page_cache": "warm for the disk mode (the model was just written)",
                  "weight_source_after_last_rollout": sources},
        "results": results,
        "disk_vs_cache_median": round(results["disk"]["median_ms"] / results["cache"]["median_ms"], 1),
    }
    path = write_report(args.out, "managed_rollout-{date}", report)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
