"""A real transformer's forward pass on the GPU: attached weights vs the same model
loaded from disk, bit for bit. The model is generated from a transformers config with
random weights (about 3.4 GB in bf16), so nothing is downloaded."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from weightcache.client import attach, bind, compare_with_disk, gpu  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="1GB", safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def test_llama_forward_on_attached_gpu_weights_is_bit_identical_to_disk(llama_dir, socket_dir, daemons):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    uuid = gpu.device_uuid(0)
    daemons.start(llama_dir, socket_dir, extra=["--backend", "cuda-vmm", "--device", uuid])
    tokens = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()

    from_disk = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        expected = from_disk(tokens).logits
    del from_disk
    torch.cuda.empty_cache()

    config = AutoConfig.from_pretrained(llama_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    attached = attach(llama_dir, socket_dir=socket_dir, device=uuid)
    assert attached.resident_bytes > 3e9
    assert compare_with_disk(attached.tensors, llama_dir) == []
    bind(model, attached.tensors)
    model.cuda().eval()  # moves only the small non-persistent buffers; weights are already there
    assert model.model.embed_tokens.weight.data_ptr() == attached.tensors["model.embed_tokens.weight"].data_ptr()
    buffers = {n: b for n, b in model.named_buffers()}
    with torch.inference_mode():
        actual = model(tokens).logits
    assert torch.equal(actual, expected), {n: b.flatten()[:4].tolist() for n, b in buffers.items()}
