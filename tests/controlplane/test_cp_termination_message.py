"""terminationMessagePolicy: FallbackToLogsOnError, as the kubelet does it: a container
that fails gets the tail of its log (last 80 lines, at most 2048 bytes) as its
termination message; one that succeeds, or has the default policy, gets none."""

from __future__ import annotations

import sys

from cluster.containers import TAIL_BYTES, TAIL_LINES, log_tail
from cluster.procs import spawn
from cluster.testkit import TEST_IMAGE, apply, container, container_status, pod, wait_pod


def _run(tmp_path, code: str, name: str = "c.log"):
    log = tmp_path / name
    offset = log.stat().st_size if log.exists() else 0
    spawn([sys.executable, "-c", code], log).wait()
    return log, offset


def test_tail_is_the_last_80_lines_of_this_run_only(tmp_path):
    log, _ = _run(tmp_path, "print('an earlier run')")
    log, offset = _run(tmp_path, "for i in range(100): print(f'line {i}')")
    tail = log_tail(log, offset)
    assert tail == "".join(f"line {i}\n" for i in range(100 - TAIL_LINES, 100))


def test_tail_of_a_short_run_has_no_spawn_header_nor_earlier_runs(tmp_path):
    _run(tmp_path, "print('an earlier run')")
    log, offset = _run(tmp_path, "import sys; print('out'); print('err', file=sys.stderr)")
    assert log_tail(log, offset) == "out\nerr\n"


def test_tail_is_at_most_2048_bytes_ending_at_the_last_byte(tmp_path):
    log, offset = _run(tmp_path, "for i in range(10): print(str(i) * 500)")
    tail = log_tail(log, offset)
    assert len(tail.encode()) == TAIL_BYTES and tail.endswith("9" * 500 + "\n")


def test_tail_of_nothing_is_empty(tmp_path):
    log, offset = _run(tmp_path, "pass")
    assert log_tail(log, offset) == "" and log_tail(tmp_path / "missing.log", 0) == ""


def test_failed_container_shows_its_log_tail_in_the_pod_status(cluster, namespace):
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    many = container("many", TEST_IMAGE, ["python", "-c", "import sys\nfor i in range(100): print(f'line {i}')\n"
                                          "sys.exit(3)"], **fallback)
    wide = container("wide", TEST_IMAGE, ["python", "-c", "import sys\nfor i in range(10): print(str(i) * 500)\n"
                                          "sys.exit(1)"], **fallback)
    fine = container("fine", TEST_IMAGE, ["python", "-c", "print('all good')"], **fallback)
    plain = container("plain", TEST_IMAGE, ["python", "-c", "import sys; print('unseen'); sys.exit(2)"])
    apply(cluster, namespace, pod("term", [many, wide, fine, plain], restartPolicy="Never"))

    def all_terminated(p):
        return all("terminated" in container_status(p, n).get("state", {}) for n in ("many", "wide", "fine", "plain"))
    p = wait_pod(cluster, namespace, "term", all_terminated, "every container terminated", timeout=60)
    term = {n: container_status(p, n)["state"]["terminated"] for n in ("many", "wide", "fine", "plain")}
    assert term["many"]["exitCode"] == 3
    assert term["many"]["message"] == "".join(f"line {i}\n" for i in range(20, 100))
    assert len(term["wide"]["message"].encode()) == 2048 and term["wide"]["message"].endswith("9" * 500 + "\n")
    assert term["fine"]["exitCode"] == 0 and "message" not in term["fine"]
    assert term["plain"]["exitCode"] == 2 and "message" not in term["plain"]
