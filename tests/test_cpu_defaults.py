"""The CPU build's defaults: eager mode, and a KV cache sized to the run instead of a fixed gigabyte."""

from __future__ import annotations

import pytest

from inspect_tl_vllm.engine.construct import CPU_KV_CACHE_CAP, cpu_defaults, cpu_kv_cache_bytes

pytestmark = pytest.mark.engine


def test_kv_cache_fits_the_sequences_the_run_can_hold(vllm_ready, tiny_llama_dir):
    model = str(tiny_llama_dir)
    per_token = 2 * 3 * 1 * 32 * 4  # key and value, 3 layers, 1 key-value head of 32, float32
    assert cpu_kv_cache_bytes(model, {"dtype": "float32", "max_model_len": 256}) == per_token * 256 * 256
    assert cpu_kv_cache_bytes(model, {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 1}) == per_token * 512
    assert cpu_kv_cache_bytes(model, {"dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 4}) == 384 * 1024
    assert cpu_kv_cache_bytes(model, {"max_model_len": 512, "max_num_seqs": 8192}) == CPU_KV_CACHE_CAP
    given = cpu_defaults({"kv_cache_memory_bytes": 123 << 20}, model)
    assert given == {"enforce_eager": True, "kv_cache_memory_bytes": 123 << 20}


def test_a_booted_cpu_engine_reserves_what_its_run_needs(tiny_engine):
    cache = tiny_engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == 2 * 3 * 1 * 32 * 4 * 256 * 256  # 48 MiB, not 1 GiB
