"""Fixtures of the vLLM tier: the vLLM venv (tests/vllm/venv.sh), a tiny generated Llama
and its greedy tokens under vLLM's own `--load-format auto`."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from server import VllmServer, vllm_python  # noqa: E402

# Token-id prompts (the servers run without a tokenizer) and how many tokens to ask for.
PROMPTS = ([1, 2, 3, 4, 5], [17, 900, 4, 256, 33, 33, 7], [999])
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def vllm_py() -> str:
    """The vLLM venv's python, this checkout installed into it. Absent venv: a skip on a
    workstation, a failure in CI (CI must run these)."""
    python = vllm_python()
    if python is None:
        message = "no vLLM venv: `make vllm-venv` builds it (~6 min cold, 6 GB, cached outside the checkout)"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the vLLM tests, but {message}")
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> pathlib.Path:
    """A 2-layer Llama (bf16 checkpoint, 1000-token vocab: vLLM pads it to 1024)."""
    from weightcache.synthetic_llama import llama_config, write_llama

    config = llama_config(hidden_size=256, intermediate_size=512, layers=2, heads=4, kv_heads=2, vocab_size=1000)
    return write_llama(tmp_path_factory.mktemp("vllm-models") / "tiny-llama", config)


def completions(server: VllmServer) -> list[list[int]]:
    return [server.complete(prompt, MAX_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="session")
def auto_tokens(vllm_py, tiny_llama, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Greedy tokens of a normal vLLM start (`--load-format auto`), per dtype asked."""
    log_dir = tmp_path_factory.mktemp("vllm-auto")
    cache: dict[str, list[list[int]]] = {}

    class Tokens(dict):
        def __missing__(self, dtype):
            with VllmServer(vllm_py, tiny_llama, log_dir / f"auto-{dtype}.log", dtype=dtype) as server:
                self[dtype] = completions(server)
            return self[dtype]

    return Tokens(cache)
