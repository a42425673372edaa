"""Write synthetic checkpoints in the Hugging Face layout, for tests and benchmarks.

Real safetensors files (written by safetensors itself), deterministic contents, any
number of tensors and shards, so a test or a benchmark can make exactly the model it
needs without downloading one.
"""

import json
import pathlib

from weightcache.client.dtypes import torch_dtype


def make_tensor(dtype_name: str, shape, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def write_model(model_dir, specs: dict, *, shards: int = 1, config: dict | None = None, seed: int = 0) -> pathlib.Path:
    """specs: tensor name -> (safetensors dtype, shape). With shards > 1 the tensors are
    spread over model-0000i-of-0000n.safetensors files with an index."""
    from safetensors.torch import save_file

    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config or {"model_type": "synthetic", "torch_dtype": "float32"}))
    names = list(specs)
    weight_map = {}
    for shard in range(shards):
        file_name = "model.safetensors" if shards == 1 else f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[shard::shards]
        tensors = {n: make_tensor(*specs[n], seed=seed + names.index(n)) for n in chunk}
        save_file(tensors, model_dir / file_name, metadata={"format": "pt"})
        weight_map.update({n: file_name for n in chunk})
    if shards > 1:
        (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir


def uniform_specs(count: int, total_bytes: int, dtype: str = "BF16") -> dict:
    """`count` square-ish 2-D tensors adding up to about total_bytes."""
    itemsize = 2 if dtype in ("BF16", "F16") else 4
    elements = max(1, total_bytes // itemsize // count)
    cols = 1024 if elements >= 1024 else elements
    rows = max(1, elements // cols)
    return {f"layers.{i}.weight": (dtype, (rows, cols)) for i in range(count)}
