"""Read a model directory into a list of validated tensor sources, trusting nothing.

Every safetensors header is checked before a byte of data is read: offsets inside the
file, no overlaps, known dtypes, sizes that match shapes. The index must agree with
the shards, and the quantization must be one the cache serves.
"""

import json
import os
import pathlib
from dataclasses import dataclass

from weightcache.client.dtypes import DTYPES
from weightcache.client.errors import CheckpointError, UnsupportedQuantization
from weightcache.client.fingerprint import quantization_of
from weightcache.client.modelfiles import checkpoint_files, read_config, read_raw_header

# Unquantized and block-wise FP8 are served; every other method would be mapped into
# wrong numbers by an engine expecting something else, so it is refused by name.
SERVED_QUANTIZATION = ("none", "fp8-block")
FP8_SCALE_SUFFIXES = ("_scale_inv", "_scale")


@dataclass(frozen=True)
class TensorSource:
    """Where a tensor's bytes are in a file: `rows` pieces of nbytes/rows bytes, `pitch`
    bytes apart (one contiguous range unless a tensor-parallel shard cut its rows)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: pathlib.Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    rows: int = 1
    pitch: int = 0


@dataclass(frozen=True)
class Checkpoint:
    model_dir: pathlib.Path
    config: dict
    quantization: str
    tensors: tuple[TensorSource, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(path: pathlib.Path, raw: bytes, file_size: int) -> list[TensorSource]:
    """Validate one safetensors header (its JSON bytes) against the file's size."""
    def bad(problem):
        return CheckpointError(f"{path}: {problem}")

    try:
        # UTF-8 only, as safetensors reads it: json.loads(bytes) would also take UTF-16/32.
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"header is not valid JSON in UTF-8 ({exc})") from None
    if not isinstance(header, dict):
        raise bad(f"header must be a JSON object, found {type(header).__name__}")
    data_start = 8 + len(raw)
    data_len = file_size - data_start
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must map strings to strings")
    tensors = []
    for name, entry in header.items():
        if not name:
            raise bad("a tensor has an empty name")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: expected exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}] fall outside the "
                      f"{data_len} data bytes of the file")
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise bad(f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes "
                      f"but data_offsets span {end - begin}")
        tensors.append(TensorSource(name, dtype, tuple(shape), path, data_start + begin, expected))
    _check_overlaps(path, tensors)
    return tensors


def _check_overlaps(path, tensors) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise CheckpointError(f"{path}: tensors {prev!r} and {name!r} overlap in the file")


def _check_fp8_scales(model_dir, tensors) -> None:
    names = {t.name for t in tensors}
    for t in tensors:
        if t.dtype.startswith("F8_") and t.name.endswith(".weight"):
            if not any(t.name + suffix in names for suffix in FP8_SCALE_SUFFIXES):
                raise CheckpointError(f"{model_dir}: fp8 weight {t.name!r} has no scale tensor "
                                      f"({t.name}_scale_inv); block-wise FP8 needs its scales")


def read_checkpoint(model_dir) -> Checkpoint:
    model_dir = pathlib.Path(model_dir)
    config = read_config(model_dir)
    quantization, _ = quantization_of(config)
    if quantization not in SERVED_QUANTIZATION:
        raise UnsupportedQuantization(
            f"{model_dir}: quantization {quantization!r} is not served. weightcache serves unquantized and "
            "block-wise FP8 (quantization_config.weight_block_size) checkpoints only, so that no engine maps "
            "bytes it would read as different numbers; load this model from disk (WEIGHTCACHE_MODE=off)."
        )
    files, weight_map = checkpoint_files(model_dir)
    tensors: list[TensorSource] = []
    where: dict[str, str] = {}
    for path in files:
        for t in parse_header(path, read_raw_header(path), os.stat(path).st_size):
            if t.name in where:
                raise CheckpointError(f"{model_dir}: tensor {t.name!r} appears in both {where[t.name]} and {path.name}")
            where[t.name] = path.name
            tensors.append(t)
    if weight_map is not None:
        wrong = [f"{n} (index: {f}, found in: {where.get(n, 'none of the shards the index names')})"
                 for n, f in weight_map.items() if where.get(n) != f]
        unlisted = sorted(set(where) - set(weight_map))
        if wrong or unlisted:
            raise CheckpointError(f"{model_dir}: the index disagrees with the shards: "
                                  + "; ".join(wrong[:5] + [f"{n} (in {where[n]}, not in the index)" for n in unlisted[:5]]))
    if quantization == "fp8-block":
        _check_fp8_scales(model_dir, tensors)
    return Checkpoint(model_dir, config, quantization, tuple(tensors))
