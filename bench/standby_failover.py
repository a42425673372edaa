"""Failover time of an inference Deployment when its engine process is killed, three ways,
in one run, on the test control plane (real kube-apiserver, controller-manager and
scheduler; the node simulator runs the pods as local processes; cpu backend):

  standby    weightcache.io/hot-standby: "1": the operator promotes the Ready standby
  restart    the same Deployment without standby: the kubelet restarts the engine in its
             pod, which attaches to the resident weights again
  disk       no cache: the restarted engine loads the model from disk (page cache warm)

Each trial SIGKILLs the primary's engine process (the pid its /status reports) and
times from the kill to a replacement being Ready and listed among the Service's ready
endpoints (the EndpointSlice controller's rule, from a pod watch: see
tests/controlplane/standbykit.EndpointsWatch for why not the slices themselves). The
model is generated: a BERT of about --gib GiB (float32, random weights), so the disk path
is not trivially short. A restart/disk trial runs on a fresh pod (the kubelet's restart
back-off grows with each crash of a pod; the first restart is the fair case).

    .venv/bin/python bench/standby_failover.py    # 20 standby trials, 10 of each other mode, ~2 GiB
    .venv/bin/python bench/standby_failover.py --trials 2 --baseline-trials 1 --gib 0.2   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys

from clusterbench import CACHE, MODEL, ROOT, cache_on_one_node, cpu_model, log, versions
from harness import write_report

from cluster import wait_for  # noqa: E402  (clusterbench put tests/ on the path)
from standbykit import (ROLE, STANDBY_FOR, EndpointsWatch, Env, engine_deployment, is_ready, kill_engine,  # noqa: E402
                        service)

class Bench:
    def __init__(self, env: Env, node: str) -> None:
        self.env, self.node = env, node

    def pods(self, app: str) -> list[dict]:
        return [p for p in self.env.pods(f"app={app}") if not p["metadata"].get("deletionTimestamp")]

    def deploy(self, app: str, cache: str | None, standbys: int | None) -> EndpointsWatch:
        self.env.apply(service(app))
        manifest = engine_deployment(app, MODEL, cache, standbys)
        manifest["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.node}
        self.env.apply(manifest)
        return EndpointsWatch(self.env.cluster, self.env.ns, {"app": app})

    def settle(self) -> None:
        """Every Deployment of the run at rest: the standby pair Ready, the others' pods
        fresh and Ready."""
        self.standby_pair("estan")
        self.fresh_pod("erest")
        self.fresh_pod("edisk")

    # -- standby --------------------------------------------------------------------------
    def standby_pair(self, app: str) -> tuple[dict, dict]:
        def check():
            ps = self.pods(app)
            ss = [s for s in self.env.pods(f"{ROLE}=standby") if not s["metadata"].get("deletionTimestamp")]
            if len(ps) == 1 and len(ss) == 1 and is_ready(ps[0]) and is_ready(ss[0]) \
                    and ss[0]["metadata"]["labels"][STANDBY_FOR] == ps[0]["metadata"]["name"]:
                return ps[0], ss[0]
            return None
        return wait_for(check, 600, "a Ready primary with a Ready standby", interval=0.3)

    def standby_trial(self, app: str, watch: EndpointsWatch) -> float:
        primary, standby = self.standby_pair(app)
        ip = standby["status"]["podIP"]
        t0 = kill_engine(primary)
        t = watch.wait(lambda ready: ip in ready, t0, 120, f"standby {standby['metadata']['name']} listed")
        # The dead primary gone (the ReplicaSet removes it) before the next trial.
        wait_for(lambda: self.env.get("pod", primary["metadata"]["name"]) is None, 120, "dead primary removed",
                 interval=0.3)
        return (t - t0) * 1e3

    # -- restart / disk -------------------------------------------------------------------
    def fresh_pod(self, app: str) -> dict:
        def check():
            ps = self.pods(app)
            if len(ps) == 1 and is_ready(ps[0]) and all(s["restartCount"] == 0 for s in
                                                        ps[0]["status"]["containerStatuses"]):
                return ps[0]
            return None
        return wait_for(check, 600, f"a fresh Ready {app} pod", interval=0.3)

    def restart_trial(self, app: str, watch: EndpointsWatch) -> float:
        pod = self.fresh_pod(app)
        ip = pod["status"]["podIP"]
        t0 = kill_engine(pod)
        gone = watch.wait(lambda ready: ip not in ready, t0, 60, f"{ip} not ready")
        t = watch.wait(lambda ready: ip in ready, gone, 600, f"{ip} ready again")
        # A fresh pod for the next trial: the first restart of a pod is the fair case.
        self.env.cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", self.env.ns, "--wait=false")
        return (t - t0) * 1e3


def summary(samples: list[float]) -> dict:
    return {"trials": len(samples), "median_ms": round(statistics.median(samples), 1),
            "worst_ms": round(max(samples), 1), "best_ms": round(min(samples), 1),
            "samples_ms": [round(s, 1) for s in samples]}


def print_failover_table(results: dict) -> None:
    base = results["standby"]
    print(f"{'mode':<44} {'trials':>6} {'median ms':>10} {'worst ms':>10} {'median vs standby':>18} "
          f"{'worst vs standby':>17}")
    for mode, r in results.items():
        print(f"{r['label']:<44} {r['trials']:>6} {r['median_ms']:>10.1f} {r['worst_ms']:>10.1f} "
              f"{r['median_ms'] / base['median_ms']:>17.1f}x {r['worst_ms'] / base['worst_ms']:>16.1f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="kills with the standby (default 20)")
    ap.add_argument("--baseline-trials", type=int, default=10,
                    help="kills in each mode without standby (default 10: each costs two engine start-ups)")
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB (default 2)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    baseline = args.baseline_trials
    started = datetime.datetime.now(datetime.timezone.utc)

    with cache_on_one_node("wcb", args.gib) as (env, node, model):
        bench = Bench(env, node)
        modes = {"standby": ("hot standby promoted", CACHE, 1, bench.standby_trial, args.trials),
                 "restart": ("no standby: restarted engine attaches", CACHE, None, bench.restart_trial,
                             baseline),
                 "disk": ("no cache: restarted engine loads from disk", None, None, bench.restart_trial,
                          baseline)}
        watches = {mode: bench.deploy(f"e{mode[:4]}", cache, standbys)
                   for mode, (_, cache, standbys, _, _) in modes.items()}
        samples: dict[str, list[float]] = {mode: [] for mode in modes}
        # Rounds of one trial per mode, so that the machine's load over the run
        # weighs on every mode alike; before each kill every Deployment has
        # settled (no start-up of ours runs during a measurement).
        for r in range(max(n for *_, n in modes.values())):
            for mode, (_, _, _, trial, n) in modes.items():
                if r >= n:
                    continue
                bench.settle()
                samples[mode].append(trial(f"e{mode[:4]}", watches[mode]))
                log(f"  round {r + 1}: {mode}: {samples[mode][-1]:.0f} ms")
        for mode, watch in watches.items():
            watch.stop()
        results = {mode: {"label": modes[mode][0], **summary(samples[mode])} for mode in modes}

    print_failover_table(results)
    report = {
        "benchmark": "standby_failover",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "device": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
        "versions": versions(),
        "setup": {"cluster": "tests/cluster: kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2, "
                             "node simulator (pods as local processes)",
                  "backend": "cpu", "model": model, "trials": {"standby": args.trials, "restart": baseline, "disk": baseline},
                  "order": "rounds of one trial per mode; every Deployment settled before each kill",
                  "measured": "SIGKILL of the primary's engine process -> a replacement Ready and among the "
                              "Service's ready endpoints (pod watch, EndpointSlice controller's rule)",
                  "readiness_probe_period_s": 1,
                  "restart_backoff": "the simulator's restart back-off for a first crash is 0.5 s "
                                     "(a kubelet's grows from 10 s for repeated crashes); "
                                     "each restart/disk trial runs on a fresh pod",
                  "page_cache": "warm for the disk mode (the model was just written)"},
        "results": results,
        "ratios": {m: {"median": round(r["median_ms"] / results["standby"]["median_ms"], 1),
                       "worst": round(r["worst_ms"] / results["standby"]["worst_ms"], 1)}
                   for m, r in results.items()},
    }
    path = write_report(args.out, "standby_failover-{date}", report)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
