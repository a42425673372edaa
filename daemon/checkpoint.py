"""Read a model directory into a list of validated tensor sources, trusting nothing.

Every safetensors header is checked before a byte of data is read: offsets inside the
file, no overlaps, known dtypes, sizes that match shapes. The index must agree with
the shards, and the quantization must be one the cache serves. Every file is opened
inside the model directory (client/modelfiles.py), and the Checkpoint keeps those open
files: the loader reads the data from the very files whose headers were checked.
"""

import pathlib
from dataclasses import dataclass

from weightcache.client.dtypes import DTYPES
from weightcache.client.errors import CheckpointError, UnsupportedQuantization
from weightcache.client.fingerprint import quantization_of
from weightcache.client.modelfiles import ModelFiles, parse_json, shown

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
    """A validated checkpoint and its open files (close() it, or use it in a with-block,
    once its tensors are loaded)."""

    model_dir: pathlib.Path
    config: dict
    quantization: str
    tensors: tuple[TensorSource, ...]
    files: ModelFiles  # the files the headers were read from; the loader reads these

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(path: pathlib.Path, raw: bytes, file_size: int) -> list[TensorSource]:
    """Validate one safetensors header (its JSON bytes) against the file's size."""
    def bad(problem):
        return CheckpointError(f"{path}: {problem}")

    # UTF-8 only, as safetensors reads it: json.loads(bytes) would also take UTF-16/32.
    header = parse_json(raw, str(path), "header is ", utf8_only=True)
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
        tensor = f"tensor {shown(name, 'a tensor name')}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"{tensor}: expected exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise bad(f"{tensor}: unknown dtype {shown(dtype, 'a dtype')} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"{tensor}: shape {shown(shape)} must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise bad(f"{tensor}: data_offsets {shown(offsets)} must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise bad(f"{tensor}: data_offsets {shown(offsets)} fall outside the "
                      f"{data_len} data bytes of the file")
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise bad(f"{tensor}: shape {shown(shape)} of {dtype} needs {expected} bytes "
                      f"but data_offsets span {end - begin}")
        tensors.append(TensorSource(name, dtype, tuple(shape), path, data_start + begin, expected))
    _check_overlaps(path, tensors)
    return tensors


def _check_overlaps(path, tensors) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise CheckpointError(f"{path}: tensors {shown(prev, 'a tensor name')} and {shown(name, 'a tensor name')} "
                                  "overlap in the file")


def _check_fp8_scales(model_dir, tensors) -> None:
    names = {t.name for t in tensors}
    for t in tensors:
        if t.dtype.startswith("F8_") and t.name.endswith(".weight"):
            if not any(t.name + suffix in names for suffix in FP8_SCALE_SUFFIXES):
                raise CheckpointError(f"{model_dir}: fp8 weight {shown(t.name, 'a tensor name')} has no scale "
                                      f"tensor ({shown(t.name + '_scale_inv', 'a tensor name')}); block-wise FP8 "
                                      "needs its scales")


def read_checkpoint(model_dir) -> Checkpoint:
    """The validated checkpoint of MODEL_DIR, its files left open for the load (the
    caller closes it); on any error nothing is left open."""
    files = ModelFiles(model_dir)
    try:
        return _read(files)
    except BaseException:
        files.close()
        raise


def _read(files: ModelFiles) -> Checkpoint:
    model_dir = files.model_dir
    config = files.config()
    quantization, _ = quantization_of(config)
    if quantization not in SERVED_QUANTIZATION:
        raise UnsupportedQuantization(
            f"{model_dir}: quantization {shown(quantization, 'a method name')} is not served. weightcache serves "
            "unquantized and block-wise FP8 (quantization_config.weight_block_size) checkpoints only, so that no "
            "engine maps bytes it would read as different numbers; load this model from disk (WEIGHTCACHE_MODE=off)."
        )
    names, weight_map = files.shards()
    tensors: list[TensorSource] = []
    where: dict[str, str] = {}
    for name in names:
        for t in parse_header(files.path(name), files.raw_header(name), files.size(name)):
            if t.name in where:
                raise CheckpointError(f"{model_dir}: tensor {shown(t.name, 'a tensor name')} appears in both "
                                      f"{where[t.name]} and {name}")
            where[t.name] = name
            tensors.append(t)
    if weight_map is not None:
        wrong = [f"{shown(n, 'a tensor name')} (index: {f}, found in: "
                 f"{where.get(n, 'none of the shards the index names')})"
                 for n, f in weight_map.items() if where.get(n) != f]
        unlisted = sorted(set(where) - set(weight_map))
        if wrong or unlisted:
            raise CheckpointError(f"{model_dir}: the index disagrees with the shards: " + "; ".join(
                wrong[:5] + [f"{shown(n, 'a tensor name')} (in {where[n]}, not in the index)" for n in unlisted[:5]]))
    if quantization == "fp8-block":
        _check_fp8_scales(model_dir, tensors)
    return Checkpoint(model_dir, config, quantization, tuple(tensors), files)
