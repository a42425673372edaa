"""Which tensor-parallel rank each device of a multi-GPU daemon serves."""

import pytest

from weightcache.client.fingerprint import Parallelism
from weightcache.daemon.backends import canonical_devices
from weightcache.daemon.service import ranks_for


def test_one_device_keeps_the_configured_rank():
    assert ranks_for(Parallelism(tp_size=4, tp_rank=3), 1) == [Parallelism(tp_size=4, tp_rank=3)]


def test_devices_take_ranks_in_order_and_repeat_per_group():
    assert [p.tp_rank for p in ranks_for(Parallelism(tp_size=2), 4)] == [0, 1, 0, 1]
    assert [p.tp_rank for p in ranks_for(Parallelism(tp_size=8), 8)] == list(range(8))
    assert {p.tp_size for p in ranks_for(Parallelism(tp_size=8), 8)} == {8}


def test_replicas_without_tensor_parallelism_are_all_rank_zero():
    assert ranks_for(Parallelism(), 3) == [Parallelism()] * 3


@pytest.mark.parametrize("parallel, count, words", [
    (Parallelism(tp_size=2, tp_rank=1), 2, "--tp-rank 1 names one rank"),
    (Parallelism(tp_size=4), 6, "6 devices cannot be split into tensor-parallel groups of 4"),
])
def test_rank_layouts_that_cannot_work_are_refused(parallel, count, words):
    with pytest.raises(ValueError, match=words):
        ranks_for(parallel, count)


def test_cpu_backend_serves_one_device_whatever_is_asked():
    assert canonical_devices("cpu", ["0"]) == ["cpu"]
    assert canonical_devices("cpu", ["all"]) == ["cpu"]
