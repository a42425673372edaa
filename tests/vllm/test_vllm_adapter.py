"""`--load-format weightcache` against real vLLM (its CPU build) servers and a real store
daemon: publish on the first start, attach on the next, the same greedy tokens as
vLLM's own loader, the weights held once, and the named refusals."""

import json
import os
import pathlib
import signal

import pytest

from conftest import completions
from server import ServerFailed, VllmServer

pytestmark = pytest.mark.timeout(1200)

CACHE = "tiny"


@pytest.fixture
def store(daemons, socket_dir):
    """An empty store daemon (no --model) that this uid may publish into."""
    return daemons.start(None, socket_dir, CACHE, ["--backend", "cpu", "--allow-publish-uid", str(os.getuid())])


def cache_env(socket_dir, report: pathlib.Path, **more) -> dict:
    env = {"WEIGHTCACHE_MODE": "client", "WEIGHTCACHE_SOCKET_DIR": str(socket_dir), "WEIGHTCACHE_CACHE_NAME": CACHE,
           "WEIGHTCACHE_FALLBACK": "error", "WEIGHTCACHE_REPORT_FILE": str(report)}
    return {**env, **{f"WEIGHTCACHE_{k.upper()}": str(v) for k, v in more.items()}}


def adapter_report(server: VllmServer) -> dict:
    """The adapter's own line in the server log: path, shared and private bytes."""
    lines = [line for line in server.log_path.read_text().splitlines() if "weightcache: {" in line]
    assert lines, f"no weightcache line in the log:\n{server.log_tail()}"
    return json.loads(lines[-1].split("weightcache: ", 1)[1])


def engine_pids(server: VllmServer) -> list[int]:
    """The server and its descendants (vLLM runs the model in an EngineCore child)."""
    pids, todo = [], [server.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
            todo += [int(c) for c in (task / "children").read_text().split()]
    return pids


def memfd_memory(pid: int) -> dict:
    """kB of Rss and Pss over the process's mappings of weightcache memfds."""
    totals, current = {"Rss": 0, "Pss": 0, "mappings": 0}, False
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            current = len(fields) >= 6 and fields[5].startswith("/memfd:")
            totals["mappings"] += current
        elif current and fields[0] in ("Rss:", "Pss:"):
            totals[fields[0][:-1]] += int(fields[1])
    return totals


def weights_holder(server: VllmServer) -> tuple[int, dict]:
    """(pid, memfd memory) of the one process of this server that maps the weights."""
    holders = [(pid, memfd_memory(pid)) for pid in engine_pids(server)]
    holders = [(pid, m) for pid, m in holders if m["mappings"]]
    assert len(holders) == 1, f"expected one process mapping the weights, got {holders}"
    return holders[0]


def test_first_start_publishes_second_attaches_same_tokens(vllm_py, tiny_llama, auto_tokens, store, socket_dir,
                                                           tmp_path):
    expected = auto_tokens["float32"]
    for i, source in enumerate(("published", "cache")):
        report = tmp_path / f"report-{i}.json"
        with VllmServer(vllm_py, tiny_llama, tmp_path / f"wc-{i}.log", load_format="weightcache",
                        env=cache_env(socket_dir, report)) as server:
            assert completions(server) == expected
            engine = json.loads(report.read_text())
            assert engine["source"] == source, engine
            mine = adapter_report(server)
            assert mine["source"] == source and mine["cpu_gemm"] == "shared"
            # Every parameter lives in the daemon's slabs; only buffers are private.
            assert mine["shared_bytes"] > 0 and mine["shared_bytes"] <= engine["resident_bytes"]
            assert mine["private_tensor_bytes"] < mine["shared_bytes"] / 10
            print(f"start {i}: {source}, ready in {server.ready_s:.1f} s, weights phase {mine['weights_ms']} ms, "
                  f"shared {mine['shared_bytes']} B, private tensors {mine['private_tensor_bytes']} B")


def test_onednn_kernels_keep_normal_numerics_from_the_cache(vllm_py, tiny_llama, auto_tokens, store, socket_dir,
                                                            tmp_path):
    extra = ("--model-loader-extra-config", json.dumps({"cpu_gemm": "onednn"}))
    for i in range(2):
        with VllmServer(vllm_py, tiny_llama, tmp_path / f"wc-{i}.log", load_format="weightcache",
                        env=cache_env(socket_dir, tmp_path / "report.json"), extra_args=extra) as server:
            assert completions(server) == auto_tokens["float32"]
            assert adapter_report(server)["cpu_gemm"] == "onednn"


def test_engine_keeps_serving_after_daemon_sigkill(vllm_py, tiny_llama, auto_tokens, store, socket_dir, tmp_path):
    with VllmServer(vllm_py, tiny_llama, tmp_path / "wc.log", load_format="weightcache",
                    env=cache_env(socket_dir, tmp_path / "report.json")) as server:
        assert json.loads((tmp_path / "report.json").read_text())["source"] == "published"
        store.send_signal(signal.SIGKILL)
        store.wait()
        assert completions(server) == auto_tokens["float32"]
        assert completions(server) == auto_tokens["float32"]


def test_other_dtype_gets_named_fingerprint_mismatch(vllm_py, tiny_llama, auto_tokens, store, socket_dir, tmp_path):
    with VllmServer(vllm_py, tiny_llama, tmp_path / "fp32.log", load_format="weightcache",
                    env=cache_env(socket_dir, tmp_path / "fp32.json")):
        assert json.loads((tmp_path / "fp32.json").read_text())["source"] == "published"
    # fallback=error: the bf16 engine refuses to start, and says which field differs.
    with pytest.raises(ServerFailed) as refused:
        VllmServer(vllm_py, tiny_llama, tmp_path / "bf16-error.log", load_format="weightcache", dtype="bfloat16",
                   env=cache_env(socket_dir, tmp_path / "bf16-error.json"))
    assert "FingerprintMismatch" in str(refused.value) and "dtype" in str(refused.value)
    # fallback=disk: it starts, and says it did not attach to the float32 copy and why.
    report = tmp_path / "bf16-disk.json"
    with VllmServer(vllm_py, tiny_llama, tmp_path / "bf16-disk.log", load_format="weightcache", dtype="bfloat16",
                    env=cache_env(socket_dir, report, fallback="disk")) as server:
        engine = json.loads(report.read_text())
        assert engine["source"] != "cache" and "dtype" in engine["reason"], engine
        assert completions(server) == auto_tokens["bfloat16"]


def test_two_engines_hold_the_weights_once(vllm_py, tiny_llama, auto_tokens, store, socket_dir, tmp_path):
    env = cache_env(socket_dir, tmp_path / "report.json")
    with VllmServer(vllm_py, tiny_llama, tmp_path / "a.log", load_format="weightcache", env=env) as a, \
            VllmServer(vllm_py, tiny_llama, tmp_path / "b.log", load_format="weightcache", env=env) as b:
        assert completions(a) == completions(b) == auto_tokens["float32"]
        shared_kb = adapter_report(a)["shared_bytes"] // 1024
        (pid_a, mem_a), (pid_b, mem_b) = weights_holder(a), weights_holder(b)
        print(f"memfd memory: engine {pid_a} {mem_a}, engine {pid_b} {mem_b}, shared tensors {shared_kb} kB")
        # Each engine has touched most shared pages (all but the embedding rows of
        # tokens never looked up)...
        assert min(mem_a["Rss"], mem_b["Rss"]) >= shared_kb * 0.8
        # ...and together they pay for them once (the same physical pages): each about
        # half, both together no more than the shared bytes.
        assert max(mem_a["Pss"], mem_b["Pss"]) <= 0.6 * min(mem_a["Rss"], mem_b["Rss"])
        assert mem_a["Pss"] + mem_b["Pss"] <= shared_kb + 64
        assert adapter_report(a)["source"] == "published" and adapter_report(b)["source"] == "cache"


def test_quantized_model_is_refused_by_name(vllm_py, tiny_llama, tmp_path):
    """A model vLLM would quantize (here online fp8) never reaches the cache."""
    with pytest.raises(ServerFailed) as refused:
        VllmServer(vllm_py, tiny_llama, tmp_path / "fp8.log", load_format="weightcache", dtype="bfloat16",
                   env={"WEIGHTCACHE_MODE": "off"}, extra_args=("--quantization", "fp8"))
    assert "UnsupportedQuantization" in str(refused.value) and "'fp8'" in str(refused.value)




def test_mode_daemon_starts_a_store_the_first_vllm_publishes_and_the_next_attaches(vllm_py, tiny_llama, auto_tokens,
                                                                                   socket_dir, tmp_path):
    """Outside Kubernetes: no daemon anywhere; the first vLLM start starts a store
    (detached, it outlives vLLM), publishes into it, and the next start attaches."""
    from weightcache.client import query_status
    from weightcache.client.publish import store_sockets

    env = {"WEIGHTCACHE_MODE": "daemon", "WEIGHTCACHE_SOCKET_DIR": str(socket_dir), "WEIGHTCACHE_CACHE_NAME": CACHE,
           "WEIGHTCACHE_FALLBACK": "error"}
    assert not store_sockets(socket_dir, CACHE, "cpu")
    store_pid = None
    try:
        for i, source in enumerate(("published", "cache")):
            report = tmp_path / f"report-{i}.json"
            with VllmServer(vllm_py, tiny_llama, tmp_path / f"daemon-mode-{i}.log", load_format="weightcache",
                            env={**env, "WEIGHTCACHE_REPORT_FILE": str(report)}) as server:
                assert completions(server) == auto_tokens["float32"]
                assert json.loads(report.read_text())["source"] == source
            (path,) = store_sockets(socket_dir, CACHE, "cpu")
            status = query_status(path)
            store_pid = status.pid
            # The store outlived the vLLM that started it, and holds the one publication.
            assert status.store and [c.fingerprint.engine for c in status.caches] == ["vllm"]
    finally:
        if store_pid is not None:
            os.kill(store_pid, signal.SIGTERM)
