"""The demo end to end (`python -m weightcache.demo --json`, what `weightcache demo --json`
runs): its structure, identical outputs, memory figures. Not its timing: the timing is
the benchmark's (bench/scaling.py, BENCHMARKS.md)."""

import json
import shutil
import subprocess
import sys

import pytest

from weightcache.demo import demo_llama, format_report

pytest.importorskip("transformers")

MODES = ("cache", "disk_cold", "disk_warm")


@pytest.fixture(scope="module")
def demo():
    # Two restarts per path: enough for medians and for two engines alive at once. The
    # demo's model is generated once into ~/.cache/weightcache (about 30 s) and kept.
    out = subprocess.run([sys.executable, "-m", "weightcache.demo", "--json", "--restarts", "2"],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout), out.stderr


@pytest.mark.timeout(1200)
def test_demo_restarts_every_path_and_every_engine_computes_the_same_output(demo):
    result, _ = demo
    assert result["outputs_identical"] and result["llama_outputs_identical"]
    assert result["model"]["bytes"] >= 1 << 30 and result["restarts_per_path"] == 2
    cpu = result["backends"]["cpu"]
    assert cpu["sources"] == {"cache": ["cache"], "disk_cold": ["disk"], "disk_warm": ["disk"]}
    assert len(cpu["outputs"]) == 1 and len(cpu["outputs"][0]) == 64  # one sha256 for all six engines
    for mode in MODES:
        runs = cpu["runs"][mode]
        assert len(runs) == 2 and len({r["pid"] for r in runs}) == 2  # fresh processes
        summary = cpu["restarts"][mode]
        for key in ("first_output_ms", "weights_ms"):
            assert summary[key]["min"] <= summary[key]["median"] <= summary[key]["max"]
        assert all(r["weights_ms"] <= r["first_output_ms"] for r in runs)
    assert cpu["page_cache_before"]["disk_cold"] < 0.05  # cold means cold: the files were evicted
    assert cpu["page_cache_before"]["disk_warm"] > 0.95
    assert set(cpu["weights_phase_ratios"]) == {"disk_cold_over_cache", "disk_warm_over_cache",
                                                "disk_cold_over_attach"}
    assert result["minilm"]["identical_to_transformers"] and result["minilm"]["source"] == "cache"


@pytest.mark.timeout(1200)
def test_demo_measures_the_memory_of_engines_alive_at_once_and_the_cache_holds_the_weights_once(demo):
    result, _ = demo
    memory = result["backends"]["cpu"]["memory"]
    model_bytes = result["model"]["bytes"]
    assert memory["engines"] == 2
    for mode in ("cache", "disk_warm"):
        assert memory[mode]["Pss"] > model_bytes * 0.9  # the weights are in there, touched
    # Two engines attached: their shared memfd pages add up to one copy of the model, not two.
    assert 0.9 * model_bytes < memory["cache"]["Pss_Shmem"] < 1.1 * model_bytes
    assert memory["disk_warm"]["Pss_Shmem"] < 0.05 * model_bytes


@pytest.mark.timeout(1200)
def test_demo_report_is_a_few_readable_lines_with_medians_and_spread(demo):
    result, stderr = demo
    text = format_report(result)
    lines = text.splitlines()
    assert 8 <= len(lines) <= 14, text
    for label in ("from the cache", "from disk, cold", "from disk, warm", "bit-identical", "PSS"):
        assert label in text, text
    assert "restart 2/2" in stderr  # progress goes to stderr, the JSON alone to stdout


def test_demo_model_is_written_once_atomically_and_a_killed_write_is_cleaned_up(tmp_path):
    dims = {"hidden_size": 64, "intermediate_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab_size": 300}
    said = []
    first = demo_llama(tmp_path, dims, progress=said.append)
    assert "writing the demo model once" in said[0] and any("wrote model-" in s for s in said)
    assert (first / "config.json").exists() and (first / "model.safetensors.index.json").exists()
    assert not list(tmp_path.glob(f".{first.name}.tmp-*"))
    said.clear()
    assert demo_llama(tmp_path, dims, progress=said.append) == first and said == []  # kept, not rewritten
    assert demo_llama(tmp_path, {**dims, "layers": 3}, progress=said.append) != first  # keyed by its parameters

    # A write killed halfway leaves only a temporary directory: never taken for the
    # model, and removed by the next writer.
    shutil.rmtree(first)
    leftover = tmp_path / f".{first.name}.tmp-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    assert demo_llama(tmp_path, dims, progress=said.append) == first
    assert not leftover.exists() and (first / "model.safetensors.index.json").exists()
