"""Each vLLM-internal fact the vLLM adapter relies on, checked against the real vLLM in
the vLLM venv (tests/vllm/internals_probe.py says what each one is and why it matters)."""

import json
import pathlib
import subprocess

import pytest

PROBE = pathlib.Path(__file__).with_name("internals_probe.py")
FACTS = ["entry_point_registers_the_load_format", "base_loader_runs_create_load_then_post_process",
         "post_processing_signature", "cpu_linear_post_processing_repacks_and_drops_the_weight",
         "onednn_handler_holds_a_private_copy", "post_processing_looks_up_the_cpu_gemm_dispatch_at_call_time",
         "cpu_gemm_goes_through_layer_cpu_linear", "f_linear_matches_onednn_closely_not_bitwise",
         "attention_post_processing_writes_its_scale_buffers",
         "parameters_are_torch_empty_so_unwritten_pages_cost_nothing", "loader_extra_config_reaches_the_loader"]


@pytest.fixture(scope="module")
def facts(vllm_py) -> dict:
    out = subprocess.run([vllm_py, str(PROBE)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_probe_checks_every_fact_listed_here(facts):
    assert sorted(facts) == sorted(FACTS)


@pytest.mark.parametrize("name", FACTS)
def test_vllm_fact(facts, name):
    assert facts[name]["ok"], f"{name}: {facts[name]['detail']}"
