"""`weightcache agent` as a real process against real daemons: readiness by handshake,
fingerprint mismatches and timeouts as exit codes with reasons, losing and regaining
the daemon while running, the engine's report on /status."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from cluster.procs import free_port
from procs import http_json, wait_until
from publisher_proc import fingerprint, tensors
from weightcache.agent import EXIT_MISMATCH, EXIT_TIMEOUT, MODEL_FIELDS, expected_fields
from weightcache.client import fingerprint as fp
from weightcache.client import attach_or_publish, query_status
from weightcache.client.attach import list_sockets
from weightcache.synthetic import write_model


class Agent:
    """A `weightcache agent` process; stdout and stderr kept in files."""

    def __init__(self, tmp_path, socket_dir, model, *extra, cache="test", revision="r1"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        n = len(list(tmp_path.glob("agent-*.out")))
        self.out, self.err = tmp_path / f"agent-{n}.out", tmp_path / f"agent-{n}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache", "agent", "--socket-dir", str(socket_dir), "--cache", cache,
                 "--model", str(model), "--revision", revision, "--http-bind", f"127.0.0.1:{self.port}",
                 "--poll-interval", "0.1", *map(str, extra)], stdout=out, stderr=err)

    def get(self, route: str) -> tuple[int | None, dict | None]:
        """(status, JSON) of a GET; (None, None) while the agent is not listening yet."""
        try:
            return http_json(self.url + route, timeout=10)
        except OSError:
            assert self.proc.poll() is None, f"agent exited {self.proc.returncode}: {self.err.read_text()}"
            return None, None

    def serving(self) -> bool:
        return self.get("/healthz")[0] == 200

    def ready(self) -> dict | None:
        status, doc = self.get("/ready")
        return doc if status == 200 else None

    def wait(self, timeout=30) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def agents(tmp_path):
    started = []

    def start(*args, **kwargs) -> Agent:
        agent = Agent(tmp_path, *args, **kwargs)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another checkpoint: same shapes elsewhere would hash differently; here the dtype differs too."""
    return write_model(tmp_path_factory.mktemp("other") / "other", {"w": ("BF16", (8, 8))},
                       config={"torch_dtype": "bfloat16"})


def stale_socket(socket_dir, name):
    """A socket file nobody listens on (what a SIGKILLed daemon leaves)."""
    socket_dir.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(socket_dir / name))
    s.close()


def test_expected_fields_are_the_fingerprint_the_engine_computes(small_model):
    # The agent computes them without torch; they must be what fp.compute gives an engine.
    full = fp.fields(fp.compute(small_model, revision="r9", parallel=fp.Parallelism(tp_size=2)))
    mine = expected_fields(small_model, "r9", 2)
    assert set(mine) == set(MODEL_FIELDS)
    assert mine == {k: full[k] for k in MODEL_FIELDS}
    assert "tp_size" not in expected_fields(small_model, "r9", None)


def test_agent_gates_until_the_daemon_answers_then_reports_it(small_model, socket_dir, daemons, engines, agents,
                                                              tmp_path):
    report = tmp_path / "engine.json"
    agent = agents(socket_dir, small_model, "--report-file", report)
    wait_until(agent.serving, 30, "agent serving /healthz")
    status, doc = http_json(agent.url + "/ready", timeout=10)
    assert status == 503 and doc["reason"] == "NoSocket" and "no socket of cache test" in doc["message"]
    assert doc["engine"] is None

    daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    doc = wait_until(agent.ready, 30, "agent ready")
    (path,) = list_sockets(socket_dir, "test")
    assert doc["daemon"]["fingerprint"] == query_status(path).fingerprint_digest
    assert doc["attached_clients"] == 0 and doc["ready_since"]

    engine = engines(small_model, socket_dir, mode="client", fallback="error", cache_name="test", revision="r1",
                     report_file=report)
    assert engine.hello["source"] == "cache"
    doc = wait_until(lambda: (lambda d: d if d["attached_clients"] == 1 else None)(http_json(agent.url + "/status", timeout=10)[1]),
                     10, "the engine counted as attached")
    assert doc["engine"]["source"] == "cache" and doc["engine"]["pid"] == engine.hello["pid"]
    assert doc["engine"]["fingerprint"] == doc["daemon"]["fingerprint"]
    assert doc["engine"]["attach_ms"] > 0


def test_agent_exits_3_naming_each_differing_field_with_both_values(small_model, other_model, socket_dir, daemons,
                                                                     agents):
    daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    agent = agents(socket_dir, other_model, "--json", revision="r2")
    assert agent.wait() == EXIT_MISMATCH
    err = agent.err.read_text()
    assert "FingerprintMismatch" in err
    for name, want, got in [("revision", "r2", "r1"), ("dtype", "bfloat16", "float32")]:
        assert f"{name}: --model gives {want!r}, daemon has {got!r}" in err
    assert "model_hash: --model gives" in err
    # The summary is the log's last word: the kubelet's FallbackToLogsOnError shows the tail.
    assert err.rstrip().splitlines()[-1].lstrip().startswith(list_sockets(socket_dir)[0].name)
    doc = json.loads(agent.out.read_text())
    assert doc["exit_code"] == EXIT_MISMATCH and doc["ready"] is False
    (answer,) = doc["sockets"]
    assert {m[0] for m in answer["mismatches"]} == {"model_hash", "revision", "dtype"}


def test_agent_exits_4_after_wait_timeout_saying_what_each_socket_answered(small_model, socket_dir, agents):
    stale_socket(socket_dir, "test__cpu__0123456789ab.sock")
    agent = agents(socket_dir, small_model, "--wait-timeout", "1", "--json")
    assert agent.wait() == EXIT_TIMEOUT
    err = agent.err.read_text()
    assert "NoDaemonAnswered" in err and "after 1s" in err
    assert "test__cpu__0123456789ab.sock: no daemon listening (a stale socket file)" in err
    assert json.loads(agent.out.read_text())["reason"] == "NoDaemonAnswered"


def test_agent_exits_4_when_no_socket_appears(small_model, socket_dir, agents):
    agent = agents(socket_dir, small_model, "--wait-timeout", "0.5")
    assert agent.wait() == EXIT_TIMEOUT
    assert "no socket of the cache appeared" in agent.err.read_text()


def test_agent_turns_unready_when_the_daemon_dies_and_ready_after_a_restart(small_model, socket_dir, daemons,
                                                                              agents):
    first = daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    agent = agents(socket_dir, small_model)
    wait_until(agent.ready, 30, "agent ready")

    first.send_signal(signal.SIGKILL)
    first.wait()

    def settled_unready():
        # A check racing the kill may see the connection reset first; then the dead
        # daemon's socket file refuses connections, which is what the agent must say.
        status, doc = http_json(agent.url + "/ready", timeout=10)
        return doc if status == 503 and "stale socket" in doc["message"] else None
    doc = wait_until(settled_unready, 10, "agent unready after the daemon's SIGKILL, naming the stale socket")
    assert doc["reason"] == "NoDaemonAnswered"
    assert doc["ready_since"] is None and doc["daemon"] is None
    assert http_json(agent.url + "/status", timeout=10)[1]["reason"] == "NoDaemonAnswered"
    assert agent.proc.poll() is None  # it reports; it does not exit

    second = daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    doc = wait_until(agent.ready, 30, "agent ready again")
    assert doc["daemon"]["pid"] == second.pid
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait() == 0


def test_a_stale_socket_beside_a_live_daemon_does_not_block_readiness(small_model, socket_dir, daemons, agents):
    daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    stale_socket(socket_dir, "test__cpu__0123456789ab.sock")
    agent = agents(socket_dir, small_model)
    doc = wait_until(agent.ready, 30, "agent ready")
    states = sorted(s["state"] for s in doc["sockets"])
    assert states == ["match", "unreachable"]


def test_a_daemon_of_another_cache_is_not_this_cache(small_model, socket_dir, daemons, agents):
    daemons.start(small_model, socket_dir, name="other", extra=["--revision", "r1"])
    agent = agents(socket_dir, small_model, "--wait-timeout", "0.5")
    assert agent.wait() == EXIT_TIMEOUT
    assert "no socket of the cache appeared" in agent.err.read_text()


def test_an_unreadable_engine_report_is_said_not_hidden(small_model, socket_dir, agents, tmp_path):
    report = tmp_path / "engine.json"
    report.write_text("{not json")
    agent = agents(socket_dir, small_model, "--report-file", report)
    wait_until(agent.serving, 30, "agent serving")
    doc = http_json(agent.url + "/status", timeout=10)[1]
    assert doc["engine"] is None and str(report) in doc["engine_report_error"]


def test_agent_with_a_missing_model_exits_2_naming_it(socket_dir, agents, tmp_path):
    agent = agents(socket_dir, tmp_path / "nowhere")
    assert agent.wait() == 2
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in agent.err.read_text()


def test_a_hung_daemon_is_not_ready_and_is_named_as_not_answering(small_model, socket_dir, daemons, agents):
    daemon = daemons.start(small_model, socket_dir, extra=["--revision", "r1"])
    agent = agents(socket_dir, small_model, "--handshake-timeout", "0.3")
    wait_until(agent.ready, 30, "agent ready")
    daemon.send_signal(signal.SIGSTOP)  # the socket still accepts; nobody answers
    try:
        doc = wait_until(lambda: (lambda s, d: d if s == 503 else None)(*agent.get("/ready")), 10,
                         "agent unready while the daemon hangs")
        assert doc["reason"] == "NoDaemonAnswered" and "TimeoutError" in doc["message"]
    finally:
        daemon.send_signal(signal.SIGCONT)
    wait_until(agent.ready, 10, "agent ready once the daemon answers again")


# -- stores (WeightCache source Published) ---------------------------------------------------------
def test_a_store_agent_is_ready_on_the_empty_store_and_lists_what_engines_publish(small_model, socket_dir, daemons,
                                                                                   agents, tmp_path):
    """--store: ready once the store answers the handshake, empty or not (the engine's own
    fingerprint is not the agent's to compute); /status then lists each published cache,
    whether it was made from --model's checkpoint, and the engine's report."""
    report = tmp_path / "engine.json"
    agent = agents(socket_dir, small_model, "--store", "--report-file", report)
    wait_until(agent.serving, 30, "agent serving /healthz")
    assert agent.get("/ready")[1]["reason"] == "NoSocket"
    daemons.start(None, socket_dir, extra=["--allow-publish-uid", str(os.geteuid())])
    doc = wait_until(agent.ready, 30, "agent ready on the empty store")
    assert doc["store"] is True and doc["caches"] == [] and doc["daemon"]["store"] is True
    assert "empty: the first engine on the node publishes" in doc["sockets"][0]["message"]

    loaded = attach_or_publish(fingerprint(small_model), load=lambda: tensors(1), socket_dir=str(socket_dir),
                               cache_name="test", mode="client", fallback="error", report_file=str(report))
    assert loaded.source == "published"

    def listed():
        d = http_json(agent.url + "/status", timeout=10)[1]
        return d if d["caches"] and d["engine"] else None
    doc = wait_until(listed, 10, "the published cache and the engine's report on /status")
    (held,) = doc["caches"]
    assert held["engine"] == "testengine" and held["of_this_model"] is True and held["attached_clients"] == 1
    assert held["fingerprint"] == doc["engine"]["fingerprint"] and doc["engine"]["source"] == "published"
    assert held["resident_bytes"] == loaded.resident_bytes > 0 and doc["attached_clients"] == 1


def test_a_store_agent_ignores_a_loaded_daemon_and_a_checkpoint_agent_ignores_a_store(small_model, socket_dir,
                                                                                     daemons, agents):
    """The two kinds of daemon may serve one cache name side by side: each agent asks
    only its own kind (a store's empty fingerprint is no mismatch of a checkpoint)."""
    daemons.start(None, socket_dir, name="store", extra=["--allow-publish-uid", "0"])
    checkpoint = agents(socket_dir, small_model, "--wait-timeout", "1", cache="store")
    assert checkpoint.wait() == EXIT_TIMEOUT
    assert "no socket of the cache appeared" in checkpoint.err.read_text()
    daemons.start(small_model, socket_dir, name="loaded", extra=["--revision", "r1"])
    store = agents(socket_dir, small_model, "--store", "--wait-timeout", "1", cache="loaded")
    assert store.wait() == EXIT_TIMEOUT
    assert "no socket of the cache appeared" in store.err.read_text()
