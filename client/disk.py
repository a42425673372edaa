"""The path without a cache: load a checkpoint from disk, and compare bytes with it."""

from .errors import CheckpointError
from .fingerprint import Parallelism
from .modelfiles import ModelFiles, read_config
from .tp_plan import plan_for, shard_bounds, shard_dim


def _opened_shards(model_dir):
    """A path for each safetensors file of MODEL_DIR, opened inside it as the daemon opens
    them (modelfiles.ModelFiles): the /proc path of its open fd, which safetensors opens
    as that very file. All stay open until the caller is done with the last."""
    with ModelFiles(model_dir) as files:
        for name in files.shards()[0]:
            yield files.proc_path(name)


def load_from_disk(model_dir, device: str = "cpu", parallel: Parallelism = Parallelism(), tp_plan=None) -> dict:
    """Every tensor of the model's safetensors files, as safetensors.torch loads them.

    With tp_size > 1, this rank's shard of each tensor, cut by the same plan the daemon
    uses (tp_plan: a plan file; default: the config's base_model_tp_plan); only the
    shard's bytes are read."""
    from safetensors.torch import load_file

    if parallel.tp_size == 1:
        tensors = {}
        for path in _opened_shards(model_dir):
            tensors.update(load_file(path, device=device))
        return tensors
    plan = plan_for(read_config(model_dir), tp_plan)
    if plan is None:
        raise CheckpointError(f"{model_dir}: tensor parallel size {parallel.tp_size} needs a plan: the config has "
                              "no base_model_tp_plan; pass tp_plan (a JSON file of module pattern -> style)")
    return _load_shard(_opened_shards(model_dir), plan, parallel, device)


def _load_shard(files, plan, parallel: Parallelism, device: str) -> dict:
    from safetensors import safe_open

    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape = part.get_shape()
                dim = shard_dim(plan, name, len(shape))
                if dim is None:
                    tensor = f.get_tensor(name)
                else:
                    start, stop = shard_bounds(name, shape, dim, parallel.tp_size, parallel.tp_rank)
                    tensor = part[(slice(None),) * dim + (slice(start, stop),)]
                tensors[name] = tensor.to(device)
    return tensors


def _as_bytes(tensor):
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def compare_with_disk(tensors: dict, model_dir) -> list[str]:
    """Names whose bytes, dtype or shape differ from the checkpoint on disk, plus names
    present on one side only. Compares bytes, so NaNs and fp8 compare exactly."""
    import torch
    from safetensors import safe_open

    problems = []
    seen = set()
    for path in _opened_shards(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                seen.add(name)
                if name not in tensors:
                    problems.append(f"{name}: on disk, not attached")
                    continue
                disk, mine = f.get_tensor(name), tensors[name]
                if disk.dtype != mine.dtype or disk.shape != mine.shape:
                    problems.append(f"{name}: disk {tuple(disk.shape)} {disk.dtype}, "
                                    f"attached {tuple(mine.shape)} {mine.dtype}")
                elif not torch.equal(_as_bytes(disk), _as_bytes(mine.cpu())):
                    problems.append(f"{name}: bytes differ")
    problems += [f"{name}: attached, not on disk" for name in sorted(set(tensors) - seen)]
    return problems
