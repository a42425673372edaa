"""The node simulator's pure pieces (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

from cluster.podspec import (IMAGE_ENTRYPOINTS, IMAGE_VENVS, container_argv, container_env, expand,
                             image_repository, is_runnable, pod_groups, pod_phase, remap_path, volume_dirs)


def test_image_repository_ignores_registry_tag_and_digest():
    assert image_repository("weightcache-daemon") == "weightcache-daemon"
    assert image_repository("ghcr.io/org/weightcache-daemon:0.1") == "weightcache-daemon"
    assert image_repository("localhost:5000/weightcache-engine@sha256:ab") == "weightcache-engine"
    assert is_runnable("reg.example/x/weightcache-operator:v1") and not is_runnable("nginx:1.27")


def test_expand_follows_kubernetes_rules():
    env = {"A": "1"}
    assert expand("$(A)-$(B)-$$(A)", env) == "1-$(B)-$(A)"


def test_mount_paths_are_remapped_in_args_and_flags():
    mounts = {"/run/wc": "/tmp/n/run/wc", "/run/wc/deep": "/tmp/p/deep"}
    assert remap_path("/run/wc/sock", mounts) == "/tmp/n/run/wc/sock"
    assert remap_path("--socket=/run/wc/deep/s", mounts) == "--socket=/tmp/p/deep/s"
    assert remap_path("/run/wcx", mounts) == "/run/wcx"


def test_argv_and_env_of_a_container():
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "b"}},
           "spec": {"nodeName": "n0"}}
    c = {"name": "c", "image": "weightcache-daemon:1", "args": ["serve", "--dir=$(DIR)"],
         "env": [{"name": "DIR", "value": "/cache"},
                 {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                 {"name": "LBL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['a']"}}},
                 {"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    mounts = {"/cache": "/host/cache"}
    env = container_env(pod, c, {"PATH": "/bin"}, "127.10.0.2", "127.0.1.1",
                        lambda kind, name, key: "v" if (kind, name, key) == ("secret", "s", "k") else None, mounts)
    assert env["DIR"] == "/host/cache" and env["NODE"] == "n0" and env["LBL"] == "b" and env["K"] == "v"
    assert container_argv(c, env, mounts) == ["weightcache", "serve", "--dir=/host/cache"]


def test_hostpath_lives_under_the_node_and_emptydir_under_the_pod():
    pod = {"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/var/run/wc"}}, {"name": "e", "emptyDir": {}}]}}
    dirs = volume_dirs(pod, Path("/n"), Path("/p"))
    assert dirs == {"h": Path("/n/var/run/wc"), "e": Path("/p/volumes/e")}


def test_pod_phase():
    run = {"state": {"running": {}}}
    done0 = {"state": {"terminated": {"exitCode": 0}}}
    done1 = {"state": {"terminated": {"exitCode": 1}}}
    assert pod_phase("Always", False, [run]) == "Pending"
    assert pod_phase("Always", True, [run]) == "Running"
    assert pod_phase("Never", True, [done0]) == "Succeeded"
    assert pod_phase("Never", True, [done0, done1]) == "Failed"
    assert pod_phase("Always", True, [dict(done1, _will_restart=True)]) == "Running"


def test_a_pods_supplemental_groups_and_fs_group_reach_its_processes():
    pod = {"spec": {"securityContext": {"supplementalGroups": [60100, 5], "fsGroup": 7}}}
    assert pod_groups(pod) == [5, 7, 60100]
    assert pod_groups({"spec": {}}) == []


def test_the_vllm_image_runs_the_api_server_with_the_vllm_venvs_python():
    assert is_runnable("weightcache-vllm-cpu:0.1.0") and IMAGE_VENVS["weightcache-vllm-cpu"] == "vllm"
    c = {"name": "vllm", "image": "weightcache-vllm-cpu:0.1.0", "args": ["--model", "/m"]}
    assert container_argv(c, {}, {"/m": "/host/m"}) == [*IMAGE_ENTRYPOINTS["weightcache-vllm-cpu"], "--model",
                                                       "/host/m"]
    pod = {"metadata": {"name": "p"}, "spec": {}}
    env = container_env(pod, c, {"PATH": "/bin"}, "127.0.0.2", "127.0.0.1", lambda *a: None, {}, "/venv/bin")
    assert env["PATH"].split(":")[0] == "/venv/bin"
