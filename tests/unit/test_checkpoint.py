"""The checkpoint reader trusts nothing: every lie a model directory can tell is refused
with a CheckpointError that names the file, the tensor and the field at fault.

Good models come from weightcache.synthetic.write_model; bad ones are corrupted with raw
byte edits or written by hand (8-byte little-endian header length + JSON + data).
"""

import json
import os
import pathlib
import struct

import pytest

from weightcache.client.errors import CheckpointError, UnsupportedQuantization
from weightcache.client.modelfiles import ModelFiles, read_config
from weightcache.daemon.backends import make_backend
from weightcache.daemon.checkpoint import parse_header, read_checkpoint
from weightcache.daemon.layout import plan_slabs
from weightcache.daemon.loader import fill_slabs
from weightcache.synthetic import write_model

CONFIG = {"model_type": "synthetic", "torch_dtype": "float32"}


def safetensors_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    """A hand-made safetensors file: header is a JSON-able object or raw bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def make_dir(tmp_path, files: dict, *, config=CONFIG, index: dict | None = None) -> pathlib.Path:
    """A model directory: files maps file name -> bytes; index is the weight_map, if any."""
    model = tmp_path / "model"
    model.mkdir(parents=True)
    if config is not None:
        (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name, content in files.items():
        (model / name).write_bytes(content)
    if index is not None:
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return model


def one_tensor(name="w", dtype="F32", shape=(2, 2), offsets=None, extra=None) -> bytes:
    """A file with one tensor whose data fills the data region exactly (unless told otherwise)."""
    nbytes = 4 * 2 * 2
    header = {name: {"dtype": dtype, "shape": list(shape), "data_offsets": offsets or [0, nbytes]}}
    header.update(extra or {})
    return safetensors_bytes(header, b"\0" * nbytes)


def refused(model_dir, *needles, exc=CheckpointError) -> str:
    """read_checkpoint raises `exc`, and its message contains every needle."""
    with pytest.raises(exc) as info:
        read_checkpoint(model_dir)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def header_refused(header, *needles, data: bytes = b"") -> None:
    path = pathlib.Path("/models/x/model.safetensors")
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with pytest.raises(CheckpointError) as info:
        parse_header(path, raw, 8 + len(raw) + len(data))
    message = str(info.value)
    assert str(path) in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


# --- the file itself --------------------------------------------------------------------

def test_header_length_larger_than_the_file_is_refused_naming_the_file(tmp_path):
    model = write_model(tmp_path / "m", {"a": ("F32", (4, 4))})
    path = model / "model.safetensors"
    content = bytearray(path.read_bytes())
    content[:8] = struct.pack("<Q", len(content) * 10)
    path.write_bytes(bytes(content))
    message = refused(model, str(path), "the header length in its first 8 bytes is more than the "
                      f"{len(content) - 8} bytes after them", "truncated or not safetensors")
    assert str(len(content) * 10) not in message  # the file's own bytes are never quoted back


def test_truncated_data_region_is_refused_naming_the_tensor_and_offsets(tmp_path):
    model = write_model(tmp_path / "m", {"a": ("F32", (4, 4)), "b": ("F32", (64, 64))})
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    refused(model, str(path), "'b'", "data_offsets", "fall outside")


def test_file_shorter_than_the_length_prefix_is_refused(tmp_path):
    model = make_dir(tmp_path, {"model.safetensors": b"\x10\0\0"})
    refused(model, "model.safetensors", "3 bytes is too short")


def test_header_cut_short_is_refused_by_raw_header(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(one_tensor()[:20])
    with ModelFiles(tmp_path) as files, pytest.raises(CheckpointError, match="first 8 bytes .* truncated") as info:
        files.raw_header("x.safetensors")
    assert str(path) in str(info.value)


def test_header_that_is_not_json_is_refused(tmp_path):
    model = make_dir(tmp_path, {"model.safetensors": safetensors_bytes(b"{not json", b"")})
    refused(model, "model.safetensors", "header is not valid JSON")
    header_refused(b"\xff\xfe{}", "not valid JSON")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_header_not_in_plain_utf8_is_refused_as_safetensors_refuses_it(tmp_path, encoding):
    raw = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(encoding)
    model = make_dir(tmp_path, {"model.safetensors": safetensors_bytes(raw, b"\0" * 16)})
    refused(model, "model.safetensors", "header is not valid JSON in UTF-8")


def test_header_that_is_a_json_list_is_refused(tmp_path):
    model = make_dir(tmp_path, {"model.safetensors": safetensors_bytes([1, 2, 3])})
    refused(model, "model.safetensors", "must be a JSON object", "list")


# --- each tensor entry ------------------------------------------------------------------

def test_unknown_dtype_is_refused_naming_tensor_and_dtype(tmp_path):
    model = make_dir(tmp_path, {"model.safetensors": one_tensor(name="layers.0.w", dtype="F7")})
    refused(model, "model.safetensors", "'layers.0.w'", "unknown dtype 'F7'")


@pytest.mark.parametrize("shape", [[-1, 4], [2.0, 2], ["2", 2], [True, 4], [[2], 2], "22", None])
def test_shape_with_negative_or_non_integer_entries_is_refused(shape):
    header = {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
    header_refused(header, "'t'", "shape", "non-negative integers", data=b"\0" * 16)


@pytest.mark.parametrize("offsets", [[0, 17], [-4, 12], [8, 4], [0, 1 << 62]])
def test_data_offsets_outside_the_data_region_are_refused(tmp_path, offsets):
    model = make_dir(tmp_path, {"model.safetensors": one_tensor(offsets=offsets)})
    refused(model, "model.safetensors", "'w'", f"data_offsets [{offsets[0]}, {offsets[1]}]", "16 data bytes")


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [0, "16"], [0.0, 16], [False, 16], "0:16"])
def test_data_offsets_that_are_not_two_integers_are_refused(offsets):
    header = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": offsets}}
    header_refused(header, "'t'", "data_offsets", "two integers", data=b"\0" * 16)


def test_data_offsets_span_not_matching_shape_is_refused_with_both_sizes(tmp_path):
    header = {"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 16]}}
    model = make_dir(tmp_path, {"model.safetensors": safetensors_bytes(header, b"\0" * 32)})
    refused(model, "model.safetensors", "'w'", "needs 24 bytes", "span 16")


def test_tensor_entry_with_missing_or_extra_fields_is_refused():
    header_refused({"t": {"dtype": "F32", "shape": [1]}}, "'t'", "dtype, shape and data_offsets")
    header_refused({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, "'t'",
                   data=b"\0" * 4)
    header_refused({"t": [1, 2]}, "'t'")
    header_refused({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "empty name", data=b"\0" * 4)


def test_overlapping_tensors_are_refused_naming_both(tmp_path):
    header = {"first": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "second": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    model = make_dir(tmp_path, {"model.safetensors": safetensors_bytes(header, b"\0" * 24)})
    refused(model, "model.safetensors", "'first'", "'second'", "overlap")


@pytest.mark.parametrize("metadata", [{"format": 1}, {"format": None}, {"a": {"b": "c"}}, ["pt"], "pt", None])
def test_metadata_with_non_string_values_is_refused(metadata):
    header = {"__metadata__": metadata, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    header_refused(header, "__metadata__", "strings to strings", data=b"\0" * 4)


# --- the directory and its index --------------------------------------------------------

def test_index_naming_a_missing_shard_is_refused_naming_it(tmp_path):
    model = write_model(tmp_path / "m", {"a": ("F32", (2,)), "b": ("F32", (3,))}, shards=2)
    (model / "model-00002-of-00002.safetensors").unlink()
    refused(model, "model.safetensors.index.json", "missing", "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/passwd", "a/b.safetensors", "x.bin",
                                   "..", "", "a\\b.safetensors", "x.safetensors\0.bin", 7])
def test_index_shard_names_with_path_tricks_are_refused(tmp_path, shard):
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(one_tensor(name="a"))
    model = make_dir(tmp_path, {"model.safetensors": one_tensor(name="b")},
                     index={"a": shard, "b": "model.safetensors"})
    quoted = repr(shard) if shard != "x.safetensors\0.bin" else "a name of 18 bytes"  # never a NUL byte
    message = refused(model, "model.safetensors.index.json", f"shard name {quoted} is not allowed")
    with ModelFiles(model) as files, pytest.raises(CheckpointError) as info:  # the client side refuses it too
        files.shards()
    assert str(info.value) == message


def test_index_naming_a_tensor_in_another_shard_is_refused_naming_both_files(tmp_path):
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    model = write_model(tmp_path / "m", {"a": ("F32", (2,)), "b": ("F32", (3,)), "c": ("F32", (4,))}, shards=2)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert index["weight_map"]["a"] == one and index["weight_map"]["b"] == two
    index["weight_map"]["a"], index["weight_map"]["b"] = two, one
    index_path.write_text(json.dumps(index))
    refused(model, "index disagrees", f"'a' (index: {two}, found in: {one})", f"'b' (index: {one}, found in: {two})")


def test_index_listing_a_tensor_no_shard_holds_is_refused(tmp_path):
    model = write_model(tmp_path / "m", {"a": ("F32", (2,)), "b": ("F32", (3,))}, shards=2)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    refused(model, "index disagrees",
            "'ghost' (index: model-00001-of-00002.safetensors, found in: none of the shards the index names)")


def test_tensor_in_a_shard_but_not_in_the_index_is_refused(tmp_path):
    model = write_model(tmp_path / "m", {"a": ("F32", (2,)), "b": ("F32", (3,)), "c": ("F32", (5,))}, shards=2)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["c"]
    index_path.write_text(json.dumps(index))
    refused(model, "index disagrees", "'c' (in model-00001-of-00002.safetensors, not in the index)")


def test_same_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    model = make_dir(tmp_path, {"one.safetensors": one_tensor(name="dup"), "two.safetensors": one_tensor(name="dup")})
    refused(model, "'dup'", "one.safetensors", "two.safetensors")
    indexed = make_dir(tmp_path / "i", {"one.safetensors": one_tensor(name="dup"),
                                        "two.safetensors": safetensors_bytes({
                                            "dup": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                            "other": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
                                            b"\0" * 32)},
                       index={"dup": "one.safetensors", "other": "two.safetensors"})
    refused(indexed, "'dup'", "one.safetensors", "two.safetensors")


def test_malformed_index_is_refused(tmp_path):
    for i, index in enumerate(["{", "[]", '{"weight_map": []}', '{"metadata": {}}']):
        model = make_dir(tmp_path / str(i), {"model.safetensors": one_tensor()})
        (model / "model.safetensors.index.json").write_text(index)
        refused(model, "model.safetensors.index.json", "not a valid safetensors index")


def test_missing_config_is_refused(tmp_path):
    model = make_dir(tmp_path, {"model.safetensors": one_tensor()}, config=None)
    refused(model, "config.json", "missing")


@pytest.mark.parametrize("config, found", [("[1, 2]", "list"), ('"llama"', "str"), ("null", "NoneType"),
                                           ("{not json", "not valid JSON")])
def test_config_that_is_not_a_json_object_is_refused(tmp_path, config, found):
    model = make_dir(tmp_path, {"model.safetensors": one_tensor()}, config=config)
    refused(model, "config.json", found)
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(model)


def test_directory_without_weights_or_that_is_not_a_directory_is_refused(tmp_path):
    refused(make_dir(tmp_path, {}), "no *.safetensors files")
    with pytest.raises(CheckpointError, match="nowhere: not a directory"):
        ModelFiles(tmp_path / "nowhere")


# --- quantization -----------------------------------------------------------------------

@pytest.mark.parametrize("qc, label", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "marlin"}, "marlin"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "fp8", "weight_block_size": []}, "fp8"),
    ({"quant_method": "some-future-method"}, "some-future-method"),
    ({"bits": 4}, "unknown"),
    (["awq"], "malformed-quantization-config"),
])
def test_unserved_quantization_is_refused_naming_the_method(tmp_path, qc, label):
    model = write_model(tmp_path / "m", {"a": ("F32", (2,))},
                        config={**CONFIG, "quantization_config": qc})
    refused(model, f"quantization {label!r} is not served", exc=UnsupportedQuantization)


FP8_BLOCK = {**CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


def test_blockwise_fp8_with_scales_is_accepted(tmp_path):
    model = write_model(tmp_path / "m", {"x.weight": ("F8_E4M3", (256, 128)), "x.weight_scale_inv": ("F32", (2, 1)),
                                         "norm.weight": ("BF16", (128,))}, config=FP8_BLOCK)
    with read_checkpoint(model) as checkpoint:
        assert checkpoint.quantization == "fp8-block"
    assert {t.name: t.dtype for t in checkpoint.tensors} == {
        "x.weight": "F8_E4M3", "x.weight_scale_inv": "F32", "norm.weight": "BF16"}
    assert checkpoint.nbytes == 256 * 128 + 2 * 4 + 128 * 2


def test_blockwise_fp8_without_its_scale_is_refused_naming_the_weight(tmp_path):
    model = write_model(tmp_path / "m", {"x.weight": ("F8_E4M3", (256, 128)), "y.weight": ("F8_E4M3", (128, 128)),
                                         "y.weight_scale_inv": ("F32", (1, 1))}, config=FP8_BLOCK)
    refused(model, "'x.weight'", "no scale tensor", "x.weight_scale_inv")


# --- the good path ----------------------------------------------------------------------

def test_good_sharded_model_reads_back_every_tensor_and_byte(tmp_path):
    specs = {"embed.weight": ("F32", (100, 8)), "attn.weight": ("BF16", (8, 24)), "bias": ("F16", (24,)),
             "mask": ("BOOL", (3, 5)), "pos": ("I64", (7,)), "scalar": ("F32", ()), "empty": ("F32", (0, 4)),
             "fp8.weight": ("F8_E5M2", (4, 4))}
    model = write_model(tmp_path / "m", specs, shards=3)
    with read_checkpoint(model) as checkpoint:
        assert len(checkpoint.tensors) == len(specs)
        assert checkpoint.nbytes == 100 * 8 * 4 + 8 * 24 * 2 + 24 * 2 + 15 + 7 * 8 + 4 + 0 + 16
        assert {t.name: (t.dtype, t.shape) for t in checkpoint.tensors} == {n: (d, s) for n, (d, s) in specs.items()}
        files, weight_map = checkpoint.files.shards()
        assert len(files) == 3 and set(weight_map) == set(specs)
        for t in checkpoint.tensors:  # every source lies inside its own file, after its header
            assert t.path.name == weight_map[t.name]
            header = checkpoint.files.raw_header(t.path.name)
            assert 8 + len(header) <= t.offset <= t.offset + t.nbytes <= t.path.stat().st_size


# --- what is validated is what is loaded ---------------------------------------------------

def slab_bytes(slab) -> bytes:
    return os.pread(slab.export_fd(), slab.size, 0)


def load_into_slabs(checkpoint) -> list:
    plan = plan_slabs(checkpoint.tensors)
    slabs = [make_backend("cpu", "cpu").allocate(size, f"test:{i}") for i, size in enumerate(plan.slab_sizes)]
    fill_slabs(plan, slabs, checkpoint.files, workers=2)
    for slab in slabs:
        slab.seal()  # as the daemon does (it also drops the slab's own writable mapping)
    return plan, slabs


def test_a_shard_swapped_after_validation_loads_the_original_bytes(tmp_path):
    model = write_model(tmp_path / "m", {"w": ("F32", (64, 64))}, seed=1)
    original = (model / "model.safetensors").read_bytes()
    impostor = write_model(tmp_path / "other", {"w": ("F32", (64, 64))}, seed=2) / "model.safetensors"
    assert impostor.stat().st_size == len(original) and impostor.read_bytes() != original
    with read_checkpoint(model) as checkpoint:
        os.replace(impostor, model / "model.safetensors")  # after the header was checked, before the load
        plan, slabs = load_into_slabs(checkpoint)
    [placed] = plan.placements
    start = placed.source.offset
    assert slab_bytes(slabs[placed.slab])[placed.offset:placed.offset + placed.source.nbytes] == \
        original[start:start + placed.source.nbytes]
    for slab in slabs:
        slab.close()


def open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def test_loads_and_refusals_leave_no_fd_open(tmp_path, small_model):
    bad = make_dir(tmp_path / "bad", {"model.safetensors": one_tensor(dtype="F7")})
    before = open_fds()
    for _ in range(20):  # a daemon that loads many times must not leak one fd a load
        with read_checkpoint(small_model) as checkpoint:
            _, slabs = load_into_slabs(checkpoint)
        for slab in slabs:
            slab.close()
        with pytest.raises(CheckpointError):
            read_checkpoint(bad)
    assert open_fds() == before


def test_values_from_a_file_are_quoted_only_when_short_and_printable():
    long_name, control = "n" * 300, "w\x1b[31m"
    header_refused({long_name: {"dtype": "F32", "shape": [1]}}, "tensor a tensor name of 300 bytes")
    header_refused({control: {"dtype": "F32", "shape": [1]}}, "tensor a tensor name of 6 bytes")
    header_refused({"t": {"dtype": "x" * 100, "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype a dtype of 100 "
                   "bytes", data=b"\0" * 4)
    header_refused({"t": {"dtype": "F32", "shape": list(range(1, 100)), "data_offsets": [0, 4]}},
                   "shape a JSON list of 99 entries", data=b"\0" * 4)


def test_json_errors_say_where_never_what(tmp_path):
    header_refused(b'{"t": "\xc3\x28 secret"}', "not valid JSON in UTF-8 (an undecodable byte at offset 7)")
    header_refused(b"[" * 100_000, "nested too deeply")
    model = make_dir(tmp_path, {"model.safetensors": one_tensor()}, config='{"a": secret-value}')
    message = refused(model, "config.json", "not valid JSON (Expecting value: line 1 column 7)")
    assert "secret" not in message


def test_only_the_exact_hugging_face_layout_widens_the_root(tmp_path):
    """`<repo>/snapshots/<rev>` with a `blobs` directory beside `snapshots` may link into
    <repo>; the same links from a look-alike without `blobs` are refused."""
    for repo, has_blobs in ((tmp_path / "hf", True), (tmp_path / "lookalike", False)):
        snapshot = repo / "snapshots" / "rev"
        snapshot.mkdir(parents=True)
        store = repo / ("blobs" if has_blobs else "elsewhere")
        store.mkdir()
        (store / "weights").write_bytes(one_tensor())
        (store / "config").write_text(json.dumps(CONFIG))
        (snapshot / "model.safetensors").symlink_to(f"../../{store.name}/weights")
        (snapshot / "config.json").symlink_to(f"../../{store.name}/config")
        if has_blobs:
            with read_checkpoint(snapshot) as checkpoint:
                assert [t.name for t in checkpoint.tensors] == ["w"]
        else:
            refused(snapshot, f"config.json resolves outside the model directory {snapshot} (a symbolic link)")
    (tmp_path / "hf" / "snapshots" / "rev" / "model.safetensors").unlink()
    (tmp_path / "hf" / "snapshots" / "rev" / "model.safetensors").symlink_to("../../../lookalike/elsewhere/weights")
    refused(tmp_path / "hf" / "snapshots" / "rev",
            f"model.safetensors resolves outside the model repository {tmp_path / 'hf'}")
