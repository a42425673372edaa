"""What a writer may declare: the daemon's checks before it allocates anything, and the
catalog that holds publications within a budget (daemon/publishing.py, daemon/catalog.py)."""

import threading

import pytest

from weightcache.client import wire_pb2 as wire
from weightcache.client.fingerprint import Device
from weightcache.client.mapping import span
from weightcache.client.protocol import LAYOUT_VERSION
from weightcache.daemon.catalog import Catalog, Entry, OverBudget
from weightcache.daemon.publishing import PublicationRefused, declared_tensors, plan_publication
from weightcache.daemon.server import ResidentCache

CPU = Device(kind="cpu")


def table(*tensors) -> "wire.TensorTable":
    t = wire.TensorTable()
    for name, dtype, shape, strides in tensors:
        t.name.append(name)
        t.dtype.append(dtype)
        t.ndim.append(len(shape))
        t.shape.extend(shape)
        t.strides.extend(strides)
    return t


def request(tensors, **fingerprint) -> "wire.PublishRequest":
    fields = {"engine": "vllm", "layout_version": LAYOUT_VERSION, "device_kind": "cpu", **fingerprint}
    return wire.PublishRequest(fingerprint=wire.Fingerprint(**fields), tensors=tensors)


def test_declared_tensors_get_the_bytes_their_strides_span_in_declaration_order():
    declared = declared_tensors(table(("qkv", "BF16", (6, 4), (4, 1)), ("t", "F32", (4, 6), (1, 4)),
                                      ("scalar", "F32", (), ()), ("empty", "F16", (0, 3), (3, 1))))
    assert [(d.name, d.nbytes, d.offset) for d in declared] == [("qkv", 48, 0), ("t", 96, 1), ("scalar", 4, 2),
                                                                ("empty", 0, 3)]


def test_span_counts_first_to_one_past_last_element():
    assert span((3, 4), (4, 1)) == 12
    assert span((3, 4), (1, 3)) == 12
    assert span((2, 2), (0, 1)) == 2  # a broadcast view
    assert span((5, 0), (1, 1)) == 0


def test_plan_packs_a_publication_in_declaration_order_aligned():
    plan = plan_publication(request(table(("b", "U8", (10,), (1,)), ("a", "U8", (300,), (1,)))), CPU, 1 << 20)
    assert [(p.source.name, p.slab, p.offset) for p in plan.placements] == [("b", 0, 0), ("a", 0, 256)]


@pytest.mark.parametrize("tensors, needle", [
    (table(), "declares no tensors"),
    (table(("a", "F32", (2,), (1,)), ("a", "F32", (2,), (1,))), "'a' is declared more than once"),
    (table(("a", "F99", (2,), (1,))), "dtype #0 is not one of"),
    (table(("a", "F32", (-2,), (1,))), "must not be negative"),
    (table(("a", "F32", (2,), (-1,))), "must not be negative"),
    (table(("", "F32", (2,), (1,))), "tensor #0's name (0 bytes) is not allowed"),
    (table(("x" * 2000, "F32", (2,), (1,))), "tensor #0's name (2000 bytes)"),
    (table(("a", "F32", tuple([1] * 17), tuple([1] * 17))), "17 dimensions"),
])
def test_bad_declarations_are_refused_by_name(tensors, needle):
    with pytest.raises(PublicationRefused) as info:
        plan_publication(request(tensors), CPU, 1 << 20)
    assert needle in str(info.value)


def test_an_unprintable_name_is_refused_without_echoing_its_bytes():
    secret = "hunter2\x00\x07"
    with pytest.raises(PublicationRefused) as info:
        declared_tensors(table((secret, "F32", (2,), (1,))))
    assert "tensor #0's name (9 bytes)" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_columns_of_different_lengths_are_refused():
    t = table(("a", "F32", (2,), (1,)))
    t.dtype.append("F32")
    with pytest.raises(PublicationRefused, match="columns have different lengths"):
        declared_tensors(t)


@pytest.mark.parametrize("fields, needle", [
    ({"engine": ""}, "names no engine"),
    ({"layout_version": LAYOUT_VERSION + 1}, f"layout version {LAYOUT_VERSION + 1}"),
    ({"device_kind": "cuda"}, "device_kind is 'cuda', but this daemon's device has 'cpu'"),
    ({"compute_capability": "9.0"}, "compute_capability"),
])
def test_a_publication_names_its_engine_and_was_made_for_this_device(fields, needle):
    with pytest.raises(PublicationRefused, match=needle):
        plan_publication(request(table(("a", "F32", (2,), (1,))), **fields), CPU, 1 << 20)


# -- the catalog ---------------------------------------------------------------------

class FakeSlab:
    """Stands in for a backend slab: the catalog only frees them."""

    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def entry(engine: str, nbytes: int) -> Entry:
    layout = wire.Layout()
    layout.slabs.add(index=0, size=nbytes)
    cache = ResidentCache(name="c", backend="cpu", device="cpu", fingerprint=wire.Fingerprint(engine=engine),
                          layout=layout, slab_fds=[], model_path="", load_s=0.0)
    return Entry(cache, [FakeSlab()], publisher_uid=0)


def publish(catalog: Catalog, engine: str, nbytes: int) -> Entry:
    e = entry(engine, nbytes)
    reservation = catalog.reserve(e.digest, nbytes, wait_s=1)
    catalog.commit(reservation, e)
    return e


def test_idle_caches_are_evicted_least_recently_used_first_and_attached_ones_never():
    catalog = Catalog(budget_bytes=300, store=True)
    held, old, recent = publish(catalog, "held", 100), publish(catalog, "old", 100), None
    assert catalog.attach(held)
    recent = publish(catalog, "recent", 100)
    newcomer = publish(catalog, "new", 100)
    assert {e.cache.fingerprint.engine for e in catalog.entries()} == {"held", "recent", "new"}
    assert old.slabs[0].closed and not recent.slabs[0].closed and catalog.evictions == 1
    with pytest.raises(OverBudget, match="budget is 300 bytes and 100 of them are held"):
        catalog.reserve(entry("huge", 250).digest, 250, wait_s=1)
    assert not held.slabs[0].closed and newcomer in catalog.entries()


def test_a_second_writer_of_one_fingerprint_waits_and_gets_the_committed_entry():
    catalog = Catalog(store=True)
    e = entry("vllm", 64)
    first = catalog.reserve(e.digest, 64, wait_s=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(catalog.reserve(e.digest, 64, wait_s=10)))
    waiter.start()
    catalog.commit(first, e)
    waiter.join(timeout=10)
    assert got == [e]


def test_a_dropped_publication_frees_its_bytes_and_lets_the_next_writer_write():
    catalog = Catalog(budget_bytes=100, store=True)
    e = entry("vllm", 100)
    first = catalog.reserve(e.digest, 100, wait_s=1)
    assert catalog.used_bytes() == 100
    catalog.drop(first)
    assert catalog.used_bytes() == 0
    second = catalog.reserve(e.digest, 100, wait_s=1)
    assert second is not first and not isinstance(second, Entry)


def test_a_writer_waiting_on_one_that_never_finishes_times_out():
    catalog = Catalog(store=True)
    e = entry("vllm", 8)
    catalog.reserve(e.digest, 8, wait_s=1)
    with pytest.raises(TimeoutError, match="another writer has been publishing"):
        catalog.reserve(e.digest, 8, wait_s=0.05)


def test_find_names_the_differences_from_the_closest_cache():
    catalog = Catalog(store=True)
    catalog.add_loaded(entry("vllm", 8).cache)
    found, mismatches = catalog.find(wire.Fingerprint(engine="vllm", dtype="float32"))
    assert found is None and mismatches == [("dtype", "float32", "")]
    assert Catalog(store=True).find(wire.Fingerprint()) == (None, [])
