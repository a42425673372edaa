"""What a WeightCacheClass allows a cache (operator/classes.py): which class applies, and
every rule a cache breaks, said with the field and the rule."""

import pytest

from weightcache.operator.classes import (DEFAULT_CLASS_ANNOTATION, ClassRefused, check, class_for, refusals,
                                          selector_matches, within)


def klass(name="pool", default=False, created="2026-12-01T00:00:00Z", **spec):
    meta = {"name": name, "creationTimestamp": created}
    if default:
        meta["annotations"] = {DEFAULT_CLASS_ANNOTATION: "true"}
    return {"metadata": meta, "spec": {"modelRoots": ["/models"], **spec}}


def cache(ns="team-a", **spec):
    return {"metadata": {"name": "llama", "namespace": ns},
            "spec": {"model": {"path": "/models/llama"}, "backend": "cuda-vmm", **spec}}


def test_the_named_class_else_the_newest_default():
    a, b = klass("a", default=True, created="2026-01-01T00:00:00Z"), klass("b", default=True,
                                                                           created="2026-02-01T00:00:00Z")
    assert class_for(cache(className="a"), [a, b]) is a
    assert class_for(cache(), [a, b, klass("c")]) is b
    with pytest.raises(ClassRefused, match=r"spec.className: WeightCacheClass 'nope' does not exist"):
        class_for(cache(className="nope"), [a])
    with pytest.raises(ClassRefused, match=r"no WeightCacheClass is the default"):
        class_for(cache(), [klass("c")])


@pytest.mark.parametrize("path, root, inside", [
    ("/models", "/models", True), ("/models/llama", "/models", True), ("/models/", "/models", True),
    ("/models2", "/models", False), ("/", "/models", False), ("/etc", "/models", False),
    ("/models/../etc", "/models", False), ("/models//x", "/models", True), ("models/x", "/models", False),
    ("/var/lib/kubelet", "/var/lib/weightcache/models", False),
])
def test_within(path, root, inside):
    assert within(path, root) is inside


@pytest.mark.parametrize("spec, field", [
    ({"model": {"path": "/"}}, "spec.model.path: '/' is outside"),
    ({"model": {"path": "/etc"}}, "spec.model.path: '/etc' is outside"),
    ({"model": {"path": "/var/lib/kubelet"}}, "spec.model.path: '/var/lib/kubelet' is outside"),
    ({"model": {"path": "/m", "volume": {"hostPath": {"path": "/etc"}}}},
     "spec.model.volume.hostPath.path: '/etc' is outside"),
    ({"model": {"path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "c"}}}},
     "spec.model.volume.persistentVolumeClaim: the daemons run in the operator's namespace"),
    ({"backend": "cuda-ipc", "allowHostIPC": True}, "which WeightCacheClass 'pool' does not allow (spec.allowHostIPC)"),
])
def test_each_escalation_is_refused_by_field_and_rule(spec, field):
    broken = refusals(cache(**spec), klass(backends=["cuda-vmm", "cuda-ipc"]), {})
    assert any(field in b for b in broken), broken


def test_backends_and_host_ipc_are_the_class_s_to_allow():
    assert refusals(cache(backend="cpu"), klass(backends=["cuda-vmm"]), {}) == [
        "spec.backend: 'cpu' is not allowed by WeightCacheClass 'pool' (spec.backends: cuda-vmm)"]
    assert refusals(cache(backend="cuda-ipc", allowHostIPC=True),
                    klass(backends=["cuda-ipc"], allowHostIPC=True), {}) == []


def test_the_namespace_must_be_selected():
    cls = klass(namespaceSelector={"matchLabels": {"tier": "gold"},
                                   "matchExpressions": [{"key": "frozen", "operator": "DoesNotExist"}]})
    assert refusals(cache(), cls, {"tier": "gold"}) == []
    (why,) = refusals(cache(), cls, {"tier": "bronze"})
    assert why.startswith("namespace 'team-a' may not use WeightCacheClass 'pool'")
    assert refusals(cache(), cls, {"tier": "gold", "frozen": "1"})


def test_every_broken_rule_is_said_at_once():
    with pytest.raises(ClassRefused) as e:
        check(cache(className="pool", backend="cpu", model={"path": "/etc"}), [klass(backends=["cuda-vmm"])], {})
    assert "spec.backend" in str(e.value) and "spec.model.path: '/etc'" in str(e.value)


@pytest.mark.parametrize("selector, labels, matches", [
    (None, {}, True), ({}, {"a": "1"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
])
def test_selector_matches(selector, labels, matches):
    assert selector_matches(selector, labels) is matches
