import pathlib

import pytest

from weightcache.daemon.checkpoint import TensorSource
from weightcache.daemon.layout import contiguous_strides, plan_slabs, to_wire
from weightcache.daemon.loader import plan_reads


def source(name, nbytes, offset=0, path="a.safetensors", dtype="U8"):
    return TensorSource(name, dtype, (nbytes,), pathlib.Path(path), offset, nbytes)


def test_every_tensor_starts_on_the_alignment_and_slabs_do_not_overlap_tensors():
    tensors = [source(f"t{i}", 100 + i, offset=1000 * i) for i in range(50)]
    plan = plan_slabs(tensors, alignment=256, max_slab_bytes=4096)
    by_slab = {}
    for p in plan.placements:
        assert p.offset % 256 == 0
        by_slab.setdefault(p.slab, []).append((p.offset, p.offset + p.source.nbytes))
    for slab, spans in by_slab.items():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= plan.slab_sizes[slab] <= 4096


def test_a_tensor_larger_than_the_slab_limit_gets_a_slab_of_its_own():
    plan = plan_slabs([source("small", 10), source("huge", 10_000, offset=10), source("tail", 10, offset=10_010)],
                      alignment=64, max_slab_bytes=1024)
    slabs = {p.source.name: p.slab for p in plan.placements}
    assert len({slabs["small"], slabs["huge"], slabs["tail"]}) == 3
    assert plan.slab_sizes[slabs["huge"]] == 10_048


def test_tensors_are_packed_in_file_order_for_sequential_reads():
    tensors = [source("b", 8, offset=64, path="2.safetensors"), source("a", 8, offset=0, path="2.safetensors"),
               source("c", 8, offset=0, path="1.safetensors")]
    plan = plan_slabs(tensors, alignment=8)
    assert [p.source.name for p in plan.placements] == ["c", "a", "b"]


def test_empty_model_still_gets_one_mappable_slab():
    plan = plan_slabs([], alignment=256)
    assert plan.slab_sizes == (256,)


def test_alignment_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        plan_slabs([source("a", 1)], alignment=100)


def test_too_many_slabs_for_one_message_is_refused_with_advice():
    tensors = [source(f"t{i}", 1024, offset=1024 * i) for i in range(300)]
    with pytest.raises(ValueError, match="Raise the slab size"):
        plan_slabs(tensors, alignment=1024, max_slab_bytes=1024)


def test_reads_merge_back_to_back_tensors_and_split_into_chunks():
    tensors = [source("a", 100, offset=0), source("b", 28, offset=100), source("c", 128, offset=128)]
    plan = plan_slabs(tensors, alignment=4, max_slab_bytes=1 << 20)
    reads = plan_reads(plan, chunk_bytes=100)
    assert sum(r.nbytes for r in reads) == 256
    assert [(r.file_offset, r.slab_offset, r.nbytes) for r in reads] == [(0, 0, 100), (100, 100, 100), (200, 200, 56)]


def test_padding_breaks_a_merge():
    plan = plan_slabs([source("a", 10, offset=0), source("b", 10, offset=10)], alignment=16)
    assert [(r.file_offset, r.slab_offset) for r in plan_reads(plan)] == [(0, 0), (10, 16)]


def test_wire_layout_names_every_tensor_with_contiguous_strides():
    t = TensorSource("w", "BF16", (3, 4, 5), pathlib.Path("m.safetensors"), 0, 120)
    layout = to_wire(plan_slabs([t]))
    table = layout.tensors
    assert (list(table.name), list(table.dtype), list(table.ndim)) == (["w"], ["BF16"], [3])
    assert (list(table.shape), list(table.strides)) == ([3, 4, 5], [20, 5, 1])
    assert contiguous_strides(()) == ()
    assert contiguous_strides((0, 4)) == (4, 1)


def test_views_land_in_their_own_slab_when_slabs_share_one_mapping():
    # cuda-vmm maps every slab into one range and hands out narrows of it: a view must
    # count from its slab's start, not from the start of the whole mapping.
    import torch

    from weightcache.client.mapping import build_views

    tensors = [source(f"t{i}", 64, offset=64 * i, dtype="U8") for i in range(3)]
    layout = to_wire(plan_slabs(tensors, alignment=64, max_slab_bytes=64))
    whole = torch.arange(3 * 64, dtype=torch.uint8)
    slabs = [whole.narrow(0, 64 * i, 64) for i in range(3)]
    views = build_views(layout, slabs)
    for i in range(3):
        assert views[f"t{i}"][0].item() == 64 * i


def test_a_layout_with_mismatched_columns_or_repeated_names_is_refused():
    import torch

    from weightcache.client.errors import ProtocolError
    from weightcache.client.mapping import build_views

    layout = to_wire(plan_slabs([source("a", 8), source("b", 8, offset=8)], alignment=8))
    slabs = [torch.zeros(s.size, dtype=torch.uint8) for s in layout.slabs]
    broken = type(layout)()
    broken.CopyFrom(layout)
    broken.tensors.nbytes.append(1)
    with pytest.raises(ProtocolError, match="different lengths"):
        build_views(broken, slabs)
    repeated = type(layout)()
    repeated.CopyFrom(layout)
    repeated.tensors.name[1] = "a"
    with pytest.raises(ProtocolError, match="more than once"):
        build_views(repeated, slabs)
    outside = type(layout)()
    outside.CopyFrom(layout)
    outside.tensors.offset[1] = 1 << 20
    with pytest.raises(ProtocolError, match="do not fit slab"):
        build_views(outside, slabs)


def test_a_strided_shard_is_read_in_chunks_of_whole_rows():
    from dataclasses import replace

    t = replace(source("w", 40, offset=8), rows=10, pitch=12)  # 10 rows of 4 bytes, 12 apart
    plan = plan_slabs([t], alignment=4)
    reads = plan_reads(plan, chunk_bytes=36)
    assert [(r.file_offset, r.slab_offset, r.nbytes, r.rows) for r in reads] == [
        (8, 0, 12, 3), (44, 12, 12, 3), (80, 24, 12, 3), (116, 36, 4, 1)]
    assert all(r.pitch == 12 for r in reads)


def test_evenly_spaced_runs_split_where_the_distance_changes():
    from weightcache.client.mapping import evenly_spaced_runs

    members = [(0, "a"), (10, "b"), (20, "c"), (35, "d"), (50, "e"), (50, "f"), (51, "g")]
    assert list(evenly_spaced_runs(members)) == [(0, 10, ["a", "b", "c"]), (35, 15, ["d", "e"]),
                                                 (50, 1, ["f", "g"])]
    assert list(evenly_spaced_runs([(7, "only")])) == [(7, 0, ["only"])]


def test_views_built_in_runs_hold_exactly_their_own_bytes():
    # Layers repeat shapes at a fixed distance (built as one strided tensor, unbound);
    # an odd tensor in between breaks a run. Every view must read its own bytes.
    import torch

    from weightcache.client.mapping import build_views

    tensors, offset = [], 0
    for layer in range(5):
        for name, shape, nbytes, dtype in (("q", (8, 8), 256, "F32"), ("k", (4, 8), 128, "F32"),
                                           ("norm", (16,), 32, "BF16")):
            tensors.append(TensorSource(f"l{layer}.{name}", dtype, shape, pathlib.Path("a"), offset, nbytes))
            offset += nbytes
        if layer == 2:
            tensors.append(source("odd", 64, offset=offset))
            offset += 64
    plan = plan_slabs(tensors, alignment=32, max_slab_bytes=1 << 20)
    layout = to_wire(plan)
    slabs = [torch.randint(0, 255, (s.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(s.index))
             for s in layout.slabs]
    views = build_views(layout, slabs)
    assert len(views) == len(tensors)
    for p in plan.placements:
        view = views[p.source.name]
        expected = slabs[p.slab][p.offset:p.offset + p.source.nbytes]
        assert tuple(view.shape) == p.source.shape
        assert torch.equal(view.contiguous().view(torch.uint8).flatten(), expected), p.source.name
