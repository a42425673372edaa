"""A real vLLM OpenAI server (vLLM's CPU build) for the tests and benchmarks.

Runs in the project venv and starts `vllm.entrypoints.openai.api_server` from the vLLM
venv (tests/vllm/venv.sh) as a subprocess, on a free loopback port, with the settings
that make it start in seconds on a 2-core machine without a GPU: one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, --distributed-executor-backend uni), a 64 MiB KV
cache, eager mode and no tokenizer (prompts and answers are token ids).

    python = vllm_python()                         # None when the venv is not built
    with VllmServer(python, model_dir, log_path, load_format="weightcache") as server:
        server.complete([1, 2, 3], max_tokens=8)   # greedy token ids
"""

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV_SH = pathlib.Path(__file__).with_name("venv.sh")
sys.path.insert(0, str(REPO / "tests"))  # procs.py, when imported from bench/ too

from cluster.procs import free_port, spawn, stop  # noqa: E402
from procs import http_json, wait_until  # noqa: E402

# What makes a CPU server ready in ~20 s instead of ~60 s (three processes, a KV
# cache sized from free memory, torch.compile).
FAST_ARGS = ("--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", str(64 << 20),
             "--enforce-eager", "--skip-tokenizer-init")
FAST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def vllm_python(build: bool = True) -> str | None:
    """The vLLM venv's python with THIS checkout installed into it, or None when the
    venv was never built (`make vllm-venv`). build=True runs venv.sh when the venv is
    there (a few seconds: it re-installs the checkout); it never starts a cold build."""
    if subprocess.run(["bash", str(VENV_SH), "--check"]).returncode != 0:
        return None
    args = ["bash", str(VENV_SH)] if build else ["bash", str(VENV_SH), "--python"]
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


class ServerFailed(AssertionError):
    pass


class VllmServer:
    """One api_server process; stop() (or leaving the `with`) ends it."""

    def __init__(self, python: str, model_dir, log_path, *, load_format: str = "auto", dtype: str = "float32",
                 env: dict | None = None, extra_args=(), ready_timeout: float = 300.0):
        self.model_dir, self.log_path = str(model_dir), pathlib.Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                     "--port", str(self.port), "--model", self.model_dir, "--load-format", load_format,
                     "--dtype", dtype, *FAST_ARGS, *extra_args]
        self.started_at = time.monotonic()
        # Its own process group, SIGKILLed if the test process dies (cluster.procs.spawn).
        self.proc = spawn(self.args, self.log_path, env={**os.environ, **FAST_ENV, **(env or {})},
                          cwd=str(self.log_path.parent))
        self.ready_s = self._wait_ready(ready_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self, timeout: float) -> float:
        """Seconds from Popen until /health answers 200, failing as soon as the server exits."""
        def ready():
            if self.proc.poll() is not None:
                raise ServerFailed(f"vLLM server exited with {self.proc.returncode} before it was ready "
                                   f"({' '.join(self.args)}); log tail:\n{self.log_tail()}")
            try:  # /health answers 200 with an empty body
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    return answer.status == 200
            except OSError:
                return False  # not listening yet

        try:
            wait_until(ready, timeout=timeout, what=f"vLLM server on port {self.port}")
        except AssertionError as exc:
            if isinstance(exc, ServerFailed):
                raise
            self.stop()
            raise ServerFailed(f"{exc}; log tail:\n{self.log_tail()}") from None
        return time.monotonic() - self.started_at

    def complete_full(self, prompt_token_ids: list[int], max_tokens: int = 8, logprobs: int | None = None) -> dict:
        body = {"model": self.model_dir, "prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        status, answer = http_json(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"}, timeout=120)
        if status != 200:
            raise ServerFailed(f"/v1/completions answered {status}: {answer}; log tail:\n{self.log_tail(3000)}")
        return answer["choices"][0]

    def complete(self, prompt_token_ids: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy (temperature 0) completion: the generated token ids."""
        return list(self.complete_full(prompt_token_ids, max_tokens)["token_ids"])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM its group, SIGKILL it after TIMEOUT; returns the exit status."""
        return stop(self.proc, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
