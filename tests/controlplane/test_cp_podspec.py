"""The node simulator's pure pieces (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

from cluster.podspec import (container_argv, container_env, expand, image_repository, is_runnable, pod_phase,
                             remap_path, volume_dirs)


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
