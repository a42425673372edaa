"""The path without a cache: load a checkpoint from disk, and compare bytes with it."""

import pathlib

from .modelfiles import checkpoint_files


def load_from_disk(model_dir, device: str = "cpu") -> dict:
    """Every tensor of the model's safetensors files, as safetensors.torch loads them."""
    from safetensors.torch import load_file

    tensors = {}
    files, _ = checkpoint_files(pathlib.Path(model_dir))
    for path in files:
        tensors.update(load_file(path, device=device))
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
    files, _ = checkpoint_files(pathlib.Path(model_dir))
    for path in files:
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
