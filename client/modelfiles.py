"""The files of a model directory in the Hugging Face layout, read without trusting them.

The client reads only what the fingerprint needs (config.json and the raw safetensors
headers); the daemon's checkpoint reader validates everything on top of this.
"""

import json
import os
import pathlib
import struct

from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# The largest header the safetensors library itself accepts.
MAX_HEADER_BYTES = 100_000_000


def read_config(model_dir: pathlib.Path) -> dict:
    path = model_dir / CONFIG_FILE
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a model directory needs config.json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _safe_shard_name(model_dir: pathlib.Path, name: object, source: str) -> pathlib.Path:
    """A shard named by the index must be a plain file name inside the model directory."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name or not name.endswith(".safetensors")):
        raise CheckpointError(
            f"{source}: shard name {name!r} is not allowed; expected a plain '*.safetensors' "
            "file name in the model directory"
        )
    return model_dir / name


def checkpoint_files(model_dir: pathlib.Path) -> tuple[list[pathlib.Path], dict[str, str] | None]:
    """The safetensors files of a model, in a stable order, and the index's weight map.

    With an index, exactly the shards it names (each must exist); without one, every
    *.safetensors file in the directory.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory; --model must name a model directory")
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            index = json.loads(index_path.read_bytes())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from None
        # Few distinct shards name many tensors: check each name once. A value that is
        # not a string (any JSON may appear) is refused by _safe_shard_name.
        try:
            distinct = set(weight_map.values())
        except TypeError:  # a list or an object: unhashable, and no file name either
            distinct = [next(f for f in weight_map.values() if not isinstance(f, str))]
        files = sorted(_safe_shard_name(model_dir, f, str(index_path)) for f in distinct)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: shard(s) missing from {model_dir}: {', '.join(missing)}")
        return files, weight_map  # JSON object keys are always strings
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files and no {INDEX_FILE}")
    return files, None


def read_raw_header(path: pathlib.Path) -> bytes:
    """The JSON header bytes of a safetensors file, bounds-checked but not parsed."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{path}: header claims {length} bytes but the file has {size - 8} after the length "
                    f"(limit {MAX_HEADER_BYTES}); the file is truncated or not safetensors"
                )
            return f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
