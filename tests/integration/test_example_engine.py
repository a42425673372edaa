"""`weightcache example-engine` as real processes with the packaged all-MiniLM-L6-v2: one
attached to a real daemon, one loading from disk, compared over real HTTP."""

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.procs import free_port
from procs import http_json, wait_until
from weightcache.client import query_status
from weightcache.client.attach import list_sockets
from weightcache.client.spawn import spawn_daemon
from weightcache.demo import packaged_model_dir

SENTENCES = ["A restarting engine maps its weights instead of reading them.", "Short.",
             "Weights stay resident on the node while engines come and go."]


class EngineServer:
    def __init__(self, log: Path, env: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache", "example-engine", "--http-bind", f"127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def ready(self) -> dict | None:
        try:
            status, doc = http_json(self.url + "/ready")
        except OSError:
            assert self.proc.poll() is None, f"engine exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            return None
        return doc if status == 200 else None

    def infer(self, sentences, output="mean") -> dict:
        status, doc = http_json(self.url + "/infer", json.dumps({"sentences": sentences, "output": output}).encode())
        assert status == 200, doc
        return doc

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def work():
    path = Path(tempfile.mkdtemp(prefix="wce-", dir="/tmp"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(work):
    with open(work / "daemon.log", "wb") as log:
        proc = spawn_daemon(packaged_model_dir(), work / "s", "minilm", ["--revision", "r1"], stderr=log,
                            timeout=120)
    yield proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def client_env(work, **more) -> dict:
    return {"WEIGHTCACHE_MODE": "client", "WEIGHTCACHE_FALLBACK": "error", "WEIGHTCACHE_SOCKET_DIR": str(work / "s"),
            "WEIGHTCACHE_CACHE_NAME": "minilm", "WEIGHTCACHE_REVISION": "r1", "WEIGHTCACHE_DEVICE": "cpu",
            "WEIGHTCACHE_MODEL_DIR": str(packaged_model_dir()), **more}


@pytest.fixture(scope="module")
def engines(work, daemon):
    """A cache engine (fallback=error: attach or die) and a disk engine, started together."""
    cache = EngineServer(work / "cache-engine.log",
                         client_env(work, WEIGHTCACHE_REPORT_FILE=str(work / "cache-engine.json")))
    disk = EngineServer(work / "disk-engine.log", {"WEIGHTCACHE_MODE": "off",
                                                   "WEIGHTCACHE_REPORT_FILE": str(work / "disk-engine.json")})
    try:
        wait_until(cache.ready, 180, "cache engine ready")
        wait_until(disk.ready, 180, "disk engine ready")
        yield cache, disk
    finally:
        cache.stop()
        disk.stop()


def test_cache_engine_attaches_and_answers_exactly_as_the_disk_engine(engines, work):
    cache, disk = engines
    c, d = cache.ready(), disk.ready()
    assert c["source"] == "cache" and c["reason"].startswith("attached to ") and c["attach_ms"] > 0
    assert d["source"] == "disk" and d["reason"] == "mode=off" and d["attach_ms"] is None
    for output, key in [("mean", "embeddings"), ("last_hidden_state", "last_hidden_state")]:
        a, b = cache.infer(SENTENCES, output), disk.infer(SENTENCES, output)
        assert a["source"] == "cache" and b["source"] == "disk"
        assert a[key] == b[key]  # exact: the same bytes, the same forward pass
    emb = cache.infer(SENTENCES)["embeddings"]
    assert len(emb) == 3 and {len(e) for e in emb} == {384}
    hidden = cache.infer(SENTENCES, "last_hidden_state")["last_hidden_state"]
    assert len(hidden[1]) < len(hidden[0])  # each sentence's own tokens, not the padded batch


def test_engine_report_file_says_which_path_was_taken(engines, work):
    cache, disk = engines
    (path,) = list_sockets(work / "s", "minilm")
    report = json.loads((work / "cache-engine.json").read_text())
    assert report["source"] == "cache" and report["pid"] == cache.proc.pid
    assert report["fingerprint"] == query_status(path).fingerprint_digest and report["socket"] == str(path)
    assert report["attach_ms"] > 0 and report["resident_bytes"] > 0
    assert not list(work.glob(".*.tmp"))  # written by rename: no leftovers
    report = json.loads((work / "disk-engine.json").read_text())
    assert report["source"] == "disk" and report["fingerprint"] is None and report["pid"] == disk.proc.pid


def test_the_cache_engine_counts_as_attached_while_it_lives(engines, work):
    (path,) = list_sockets(work / "s", "minilm")
    assert query_status(path).attached_clients == 1


BAD_BODIES = [
    (b"not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'["a"]', 400, "must be a JSON object"),
    (b"{}", 400, 'missing field "sentences"'),
    (b'{"sentences": "one string"}', 400, '"sentences" must be a non-empty list of strings, not str'),
    (b'{"sentences": []}', 400, "(empty)"),
    (b'{"sentences": ["ok", 3]}', 400, '"sentences"[1] must be a string, not int'),
    (b'{"sentences": ["ok"], "output": "pooler"}', 400, '"output" must be one of mean, last_hidden_state'),
    (b'{"sentences": ["ok"], "prompt": "x"}', 400, "unknown field(s) 'prompt'"),
    (json.dumps({"sentences": ["x"] * 65}).encode(), 400, "the limit is 64"),
    (json.dumps({"sentences": ["x" * 10_001]}).encode(), 400, "the limit is 10000"),
]


@pytest.mark.parametrize("body,status,message", BAD_BODIES, ids=[m for _, _, m in BAD_BODIES])
def test_malformed_infer_bodies_get_a_clear_4xx(engines, body, status, message):
    cache, _ = engines
    got, doc = http_json(cache.url + "/infer", body)
    assert got == status and message in doc["message"], doc
    assert cache.infer(["still serving"])["source"] == "cache"


def test_an_oversized_body_is_refused_by_its_declared_length_unread(engines):
    cache, _ = engines
    conn = http.client.HTTPConnection("127.0.0.1", cache.port, timeout=30)
    conn.putrequest("POST", "/infer")
    conn.putheader("Content-Length", str(64 << 20))
    conn.endheaders()  # no body follows: the engine must answer from the header alone
    response = conn.getresponse()
    assert response.status == 413 and "the limit is 1048576" in json.loads(response.read())["message"]
    conn.close()


def test_wrong_methods_and_routes_say_what_exists(engines):
    cache, _ = engines
    assert http_json(cache.url + "/infer")[0] == 405
    status, doc = http_json(cache.url + "/nope")
    assert status == 404 and "/infer" in doc["message"]
    status, doc = http_json(cache.url + "/infer", b'{"sentences": ["a"]}', headers={"Content-Length": "x"})
    assert status == 400


def test_sigterm_stops_an_attached_engine_cleanly_and_detaches_it(work, daemon, engines):
    (path,) = list_sockets(work / "s", "minilm")
    before = query_status(path).attached_clients
    engine = EngineServer(work / "sigterm-engine.log", client_env(work))
    try:
        wait_until(engine.ready, 180, "engine ready")
        assert query_status(path).attached_clients == before + 1
        engine.proc.send_signal(signal.SIGTERM)
        assert engine.proc.wait(timeout=30) == 0
        wait_until(lambda: query_status(path).attached_clients == before, 10, "the daemon sees it detach")
    finally:
        engine.stop()


def test_fallback_error_without_a_daemon_exits_with_the_reason(work):
    engine = EngineServer(work / "nodaemon-engine.log",
                          client_env(work, WEIGHTCACHE_SOCKET_DIR=str(work / "empty"), WEIGHTCACHE_CACHE_NAME="x"))
    try:
        assert engine.proc.wait(timeout=180) == 1
        log = engine.log.read_text()
        assert "CacheUnavailable" in log and "no weightcache daemon socket for cache x" in log
    finally:
        engine.stop()


def test_load_weights_takes_the_model_dir_from_the_env_and_survives_an_unwritable_report(small_model, monkeypatch,
                                                                                        tmp_path, caplog):
    from weightcache.client import load_weights

    monkeypatch.setenv("WEIGHTCACHE_MODE", "off")
    monkeypatch.delenv("WEIGHTCACHE_MODEL_DIR", raising=False)
    with pytest.raises(ValueError, match="WEIGHTCACHE_MODEL_DIR"):
        load_weights()
    monkeypatch.setenv("WEIGHTCACHE_MODEL_DIR", str(small_model))
    monkeypatch.setenv("WEIGHTCACHE_REPORT_FILE", str(tmp_path / "no-such-dir" / "engine.json"))
    with caplog.at_level("WARNING", logger="weightcache.client"):
        loaded = load_weights()
    assert loaded.source == "disk" and loaded.tensors
    assert "could not write the engine report" in caplog.text
