"""weightcache.integrations.transformers.from_pretrained against real daemons: the
packaged all-MiniLM-L6-v2 and a generated Llama, compared with transformers' own
from_pretrained bit for bit."""

import pytest
import torch

from procs import wait_until
from weightcache.client import BindError, CacheUnavailable, query_status
from weightcache.client.attach import list_sockets
from weightcache.demo import packaged_model_dir
from weightcache.integrations.transformers import from_pretrained
from weightcache.synthetic_llama import llama_config, write_llama

transformers = pytest.importorskip("transformers")

SENTENCES = ["A restarting engine maps its weights instead of reading them.", "Short."]


@pytest.fixture(scope="module")
def minilm():
    model_dir = packaged_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    with torch.inference_mode():
        expected = transformers.AutoModel.from_pretrained(model_dir).eval()(**inputs).last_hidden_state
    return model_dir, inputs, expected


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = llama_config(hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2, vocab_size=300)
    return write_llama(tmp_path_factory.mktemp("llama") / "tiny", config, shard_bytes=100_000)


def cache_args(socket_dir, name) -> dict:
    return {"mode": "client", "fallback": "error", "socket_dir": str(socket_dir), "cache_name": name}


def test_attached_model_is_zero_copy_and_bit_identical_to_transformers(minilm, daemons, socket_dir):
    model_dir, inputs, expected = minilm
    daemons.start(model_dir, socket_dir, name="minilm")
    model, weights = from_pretrained(model_dir, transformers.AutoModel, **cache_args(socket_dir, "minilm"))
    try:
        assert weights.source == "cache" and weights.reason.startswith("attached to ")
        assert not model.training
        param = model.embeddings.word_embeddings.weight
        assert param.data_ptr() == weights.tensors["embeddings.word_embeddings.weight"].data_ptr()  # no copy
        with torch.inference_mode():
            assert torch.equal(model(**inputs).last_hidden_state, expected)
        (path,) = list_sockets(socket_dir, "minilm")
        assert query_status(path).attached_clients == 1  # the LoadedWeights keeps the engine counted
    finally:
        weights.attached.close()


def test_without_a_daemon_it_loads_from_disk_and_says_why(minilm, socket_dir):
    model_dir, inputs, expected = minilm
    model, weights = from_pretrained(model_dir, transformers.AutoModel, mode="client", fallback="disk",
                                     socket_dir=str(socket_dir), cache_name="nobody")
    assert weights.source == "disk" and weights.reason.startswith("fallback to disk: ")
    assert weights.attached is None and weights.resident_bytes == 0
    with torch.inference_mode():
        assert torch.equal(model(**inputs).last_hidden_state, expected)


def test_fallback_error_without_a_daemon_raises_cache_unavailable(minilm, socket_dir):
    with pytest.raises(CacheUnavailable, match="nobody"):
        from_pretrained(minilm[0], transformers.AutoModel, **cache_args(socket_dir, "nobody"))


def test_mode_off_reads_the_model_dir_from_the_env(minilm, monkeypatch):
    model_dir, inputs, expected = minilm
    monkeypatch.setenv("WEIGHTCACHE_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("WEIGHTCACHE_MODE", "off")
    phases = {}
    model, weights = from_pretrained(model_class=transformers.AutoModel, phases_ms=phases)
    assert (weights.source, weights.reason) == ("disk", "mode=off")
    assert set(phases) == {"build", "weights", "bind"} and all(v >= 0 for v in phases.values())
    with torch.inference_mode():
        assert torch.equal(model(**inputs).last_hidden_state, expected)


def test_a_generated_llama_binds_as_a_causal_lm_and_keeps_its_computed_buffers(tiny_llama, daemons, socket_dir):
    daemons.start(tiny_llama, socket_dir, name="llama")
    tokens = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()(tokens).logits
    model, weights = from_pretrained(tiny_llama, transformers.AutoModelForCausalLM, **cache_args(socket_dir, "llama"))
    try:
        assert type(model).__name__ == "LlamaForCausalLM" and weights.source == "cache"
        assert model.lm_head.weight.dtype == torch.bfloat16
        inv_freq = dict(model.named_buffers())["model.rotary_emb.inv_freq"]  # not in the checkpoint: computed
        assert inv_freq.device.type == "cpu" and torch.isfinite(inv_freq).all()
        with torch.inference_mode():
            assert torch.equal(model(tokens).logits, expected)
    finally:
        weights.attached.close()


def test_a_concrete_model_class_works_like_an_auto_class(tiny_llama):
    model, weights = from_pretrained(tiny_llama, transformers.LlamaForCausalLM, mode="off")
    assert type(model).__name__ == "LlamaForCausalLM" and weights.source == "disk"


def test_a_dtype_other_than_the_checkpoints_is_named_and_the_attachment_released(minilm, daemons, socket_dir):
    model_dir = minilm[0]
    daemons.start(model_dir, socket_dir, name="minilm")
    (path,) = list_sockets(socket_dir, "minilm")
    with pytest.raises(BindError, match=r"mismatch: .*torch.float16, got .*torch.float32"):
        from_pretrained(model_dir, transformers.AutoModel, dtype=torch.float16, **cache_args(socket_dir, "minilm"))
    wait_until(lambda: query_status(path).attached_clients == 0, 10, "the failed engine's attachment released")


def test_tensor_parallel_settings_are_refused_with_what_to_use_instead(minilm):
    with pytest.raises(ValueError, match="tensor parallel size 2 .*weightcache.tp_engine"):
        from_pretrained(minilm[0], transformers.AutoModel, mode="off", tp_size=2)
