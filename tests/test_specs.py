"""Spec validation and the hook table: every bad input gets an error naming field and fix."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from inspect_tl_vllm.instrument.hookpoints import ModelShape, build_sites, canonical_hook_point, layout_for
from inspect_tl_vllm.instrument.request_state import Scope
from inspect_tl_vllm.specs import InstrumentConfig, SpecError, inline_entries, parse_hook_point, parse_request_spec
from inspect_tl_vllm.vectors.files import load_vector


def test_unknown_hook_point_suggests_the_nearest():
    with pytest.raises(SpecError, match="Did you mean 'blocks.6.hook_resid_post'"):
        parse_hook_point("blocks.6.hook_resid_pst")
    with pytest.raises(SpecError, match="ln_final.hook_normalized"):
        parse_hook_point("final_norm")


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "op": "add"}]}, "needs a vector"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "op": "scale", "vector": [1.0]}]}, "takes no vector"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0, math.nan]}]}, "NaN"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [2.0, 1.0, -math.inf]}]}, "entry 2"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0], "coef": math.inf}]}, "coef"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0], "positions": []}]}, "positions"),
        ({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0], "positions": [2, 2]}]}, "duplicate"),
        ({"interventions": [{"hook": "blocks.1.hook_resid", "vector": [1.0]}]}, "unknown hook point"),
        ({"capture": {"hooks": []}}, "hooks"),
        ({"capture": {"hooks": ["blocks.0.hook_mlp_out"], "reduce": "median"}}, "reduce"),
        ({"steer": []}, "steer"),
    ],
)
def test_bad_specs_name_the_sample_and_field(raw, fragment):
    with pytest.raises(SpecError, match="sample 7") as info:
        parse_request_spec(raw, "sample 7")
    assert fragment in str(info.value)


HOOK = "blocks.1.hook_resid_post"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"op": "scale", "positions": [2**63]}, r"positions\[0\]: 9223372036854775808 is out of range"),
        ({"op": "scale", "positions": [0, -(10**30)]}, r"positions\[1\]: .* is out of range"),
        ({"op": "scale", "positions": [True]}, "valid integer"),
        ({"op": "scale", "coef": -1e30}, r"coef: -1e\+30 is out of range"),
        ({"op": "set", "vector": [1.0, 2.0], "coef": 1e39}, "out of range"),
        ({"op": "scale", "coef": float("nan")}, "finite"),
        ({"op": "ablate", "vector": [1e20, 1e20]}, r"entry 0 is 1e\+20; entries lie within"),
        ({"op": "add", "vector": [1e308, 1e308]}, "entries lie within"),
        ({"op": "add", "vector": [0.0, float("inf"), float("-inf")]}, "entry 1 is inf"),
        ({"op": "add", "vector": [1.0, float("nan")]}, "entry 1 is nan"),
    ],
)
def test_every_numeric_field_of_an_intervention_has_a_checked_range(item, message):
    with pytest.raises(SpecError, match=message):
        parse_request_spec({"interventions": [{"hook": HOOK, **item}]}, "sample 3")


def test_edges_of_the_ranges_are_accepted():
    from inspect_tl_vllm.specs import MAX_COEF, MAX_POSITION, MAX_VECTOR_ENTRY

    item = {"hook": HOOK, "vector": [MAX_VECTOR_ENTRY, -MAX_VECTOR_ENTRY], "coef": -MAX_COEF}
    spec = parse_request_spec({"interventions": [{**item, "positions": [MAX_POSITION, -MAX_POSITION]}]}, "x")
    assert spec.interventions[0].coef == -MAX_COEF
    capture = parse_request_spec({"capture": {"hooks": [HOOK], "positions": [-MAX_POSITION]}}, "x").capture
    assert capture is not None and capture.positions == [-MAX_POSITION]
    with pytest.raises(SpecError, match="out of range"):
        parse_request_spec({"capture": {"hooks": [HOOK], "positions": [MAX_POSITION + 1]}}, "x")


@pytest.mark.parametrize("name", ["blocks.012.hook_resid_post", "blocks.\u0661\u0662.hook_resid_post"])
def test_a_layer_number_has_one_spelling(name):
    with pytest.raises(SpecError, match="Did you mean 'blocks.12.hook_resid_post'"):
        parse_request_spec({"interventions": [{"hook": name, "op": "scale"}]}, "x")


def test_instrument_settings_have_upper_bounds():
    with pytest.raises(ValueError, match="max_vectors"):
        InstrumentConfig(max_vectors=1 << 20)
    with pytest.raises(ValueError, match="capture_bytes_per_request"):
        InstrumentConfig(capture_bytes_per_request=1 << 50)


def test_vector_files_out_of_range_or_not_real_are_refused(tmp_path):
    np.save(tmp_path / "huge.npy", np.array([1.0, 1e7], dtype=np.float32))
    with pytest.raises(SpecError, match="magnitude 1e\\+07 is out of range"):
        load_vector(str(tmp_path / "huge.npy"), 2)
    np.save(tmp_path / "complex.npy", np.array([1 + 2j, 3 - 1j]))
    with pytest.raises(SpecError, match="complex128 tensor; steering vectors are real numbers"):
        load_vector(str(tmp_path / "complex.npy"), 2)
    torch.save(torch.tensor([1 + 1j, 0j]), tmp_path / "complex.pt")
    with pytest.raises(SpecError, match="complex64 tensor"):
        load_vector(str(tmp_path / "complex.pt"), 2)
    with pytest.raises(SpecError, match=r"entry 0 is 3.5e\+38; entries lie within \+-1e\+06"):
        inline_entries([3.5e38, 3.5e38])  # beyond float32: the packing of an inline list names the entry


def test_inline_vectors_become_exact_float32_tensors():
    values = [0.1, -2.5, 3, 1e-30]
    assert torch.equal(load_vector(inline_entries(values), 4), torch.tensor(values, dtype=torch.float32))
    with pytest.raises(SpecError, match="entries must be numbers"):
        inline_entries([1.0, "x"])


def test_a_list_vector_is_packed_once_when_the_spec_is_checked():
    spec = parse_request_spec({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [0.1, -2.5, 3]}]})
    item = spec.interventions[0]
    entries = item.inline_vector
    assert entries.dtype == np.float32 and entries.tolist() == torch.tensor([0.1, -2.5, 3]).tolist()
    assert item.inline_vector is entries  # the front end reads the packed entries, not the list
    item.vector = [1.0, 2.0, 3.0]  # a list put in its place later is packed afresh, not shadowed
    assert item.inline_vector.tolist() == [1.0, 2.0, 3.0]
    assert item.model_dump()["vector"] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "given",
    [
        np.array([0.5, -1.25, 3.0]),  # float64
        np.array([[0.5, -1.25, 3.0]], dtype=np.float32),  # a [1, d] row
        torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
        torch.tensor([0.5, -1.25, 3.0], requires_grad=True),
        np.array([1, 2, 3], dtype=np.int64),
    ],
    ids=["float64-array", "row-array", "bfloat16-tensor", "grad-tensor", "int-array"],
)
def test_arrays_and_tensors_are_vectors_without_a_list(given):
    spec = parse_request_spec({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": given}]}, "x")
    item = spec.interventions[0]
    expected = np.array(given.detach().float().numpy() if isinstance(given, torch.Tensor) else given, dtype=np.float32)
    assert isinstance(item.vector, np.ndarray) and item.vector.dtype == np.float32
    assert np.array_equal(item.inline_vector, expected.reshape(-1))
    dumped = spec.model_dump()["interventions"][0]["vector"]
    assert dumped == expected.reshape(-1).tolist()  # logs and cache keys see plain numbers
    assert parse_request_spec(json.loads(spec.model_dump_json())).interventions[0].vector == dumped
    if isinstance(given, np.ndarray):  # a copy: changing the caller's array afterwards changes nothing
        before = item.inline_vector.copy()
        given[...] = 7
        assert np.array_equal(item.inline_vector, before)
    assert torch.equal(load_vector(item.inline_vector, 3), torch.from_numpy(expected.reshape(-1)))


def test_specs_with_array_vectors_compare_by_their_entries():
    def spec(vector):
        return parse_request_spec({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": vector}]})

    assert spec(np.arange(3.0)) == spec(torch.arange(3.0))
    assert spec(np.arange(3.0)) != spec(np.arange(1.0, 4.0))
    assert spec(np.arange(3.0)) != spec("v.safetensors") and spec("v.safetensors") != spec(np.arange(3.0))
    assert spec("v.safetensors") == spec("v.safetensors")
    assert spec([0.0, 1.0, 2.0]) == spec([0.0, 1.0, 2.0])


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        (np.array([1.0, np.nan]), "entry 1 is nan; vectors must be finite"),
        (torch.tensor([0.0, 2e6]), r"entry 1 is 2000000.0; entries lie within \+-1e\+06"),
        (np.array([1e40, 0.0]), "entry 0 is 1e\\+40"),
        (torch.tensor([1 + 1j]), "a torch.complex64 tensor; steering vectors are real numbers"),
        (np.array(["a", "b"]), "an array of <U1"),
        (np.array([True, False]), "an array of bool"),
        (np.zeros((2, 2)), r"expected a 1-D array of numbers, got shape \(2, 2\)"),
        (np.zeros(0), r"expected a 1-D array of numbers, got shape \(0,\)"),
        ({"a": 1.0}, "a list of numbers, an array, a tensor or a file path, got dict"),
    ],
)
def test_bad_arrays_and_tensors_are_refused_by_name(given, fragment):
    with pytest.raises(SpecError, match=f"x: interventions.0.vector: vector: {fragment}"):
        parse_request_spec({"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": given}]}, "x")


def shape(layers: int) -> ModelShape:
    """A small grouped-query model: 4 query heads of 3, 2 key-value heads, MLP of 20."""
    return ModelShape(num_layers=layers, d_model=12, n_heads=4, n_kv_heads=2, d_head=3, d_mlp=20)


def test_hook_table_aliases_resid_pre_onto_previous_resid_post():
    sites = build_sites(layout_for("LlamaForCausalLM"), shape(4), list(InstrumentConfig().hook_points))
    assert sites["blocks.2.hook_resid_pre"] is sites["blocks.1.hook_resid_post"]
    assert sites["blocks.0.hook_resid_pre"] is not sites["blocks.0.hook_resid_post"]
    assert len({s.index for s in sites.values()}) == 4 + 1 + 1  # resid_post x4, resid_pre.0, ln_final
    assert canonical_hook_point("blocks.3.hook_resid_pre", 4) == "blocks.2.hook_resid_post"
    with pytest.raises(SpecError, match="layer 9 does not exist"):
        canonical_hook_point("blocks.9.hook_mlp_out", 4)


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(SpecError, match="'FalconForCausalLM'.*GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        layout_for("FalconForCausalLM")


def test_gemma_attn_out_is_after_its_post_attention_norm():
    sites = build_sites(layout_for("Gemma2ForCausalLM"), shape(2), ["all"])
    assert sites["blocks.1.hook_attn_out"].module == "post_attention_layernorm"
    assert sites["blocks.1.hook_resid_mid"].module == "pre_feedforward_layernorm"


def test_per_head_and_neuron_sites_have_their_own_widths_and_all_leaves_them_out():
    every = build_sites(layout_for("LlamaForCausalLM"), shape(2), ["all"])
    assert not any(".attn." in name or ".mlp." in name for name in every)  # 'all': residual width only
    sites = build_sites(layout_for("LlamaForCausalLM"), shape(2), ["blocks.*.attn.*", "blocks.1.mlp.*"])
    widths = {name: (site.width, site.heads) for name, site in sites.items() if name.startswith("blocks.1.")}
    assert widths == {
        "blocks.1.attn.hook_q": (12, 4),
        "blocks.1.attn.hook_rot_q": (12, 4),
        "blocks.1.attn.hook_z": (12, 4),
        "blocks.1.attn.hook_k": (6, 2),
        "blocks.1.attn.hook_rot_k": (6, 2),
        "blocks.1.attn.hook_v": (6, 2),
        "blocks.1.mlp.hook_pre": (20, 0),
        "blocks.1.mlp.hook_post": (20, 0),
    }
    assert sites["blocks.1.attn.hook_v"].module == "self_attn.attn" and sites["blocks.1.attn.hook_v"].arg == 2
    with pytest.raises(SpecError, match="mixture of experts.*hook_mlp_out"):
        build_sites(layout_for("MixtralForCausalLM"), shape(2), ["blocks.0.mlp.hook_post"])


def test_heads_apply_at_per_head_hook_points_only():
    spec = {"hook": "blocks.0.attn.hook_z", "op": "scale", "coef": 0.0, "heads": [1, 3]}
    assert parse_request_spec({"interventions": [spec]}).interventions[0].heads == [1, 3]
    for bad, message in [
        ({"hook": "blocks.0.hook_resid_post"}, "not a per-head hook point"),
        ({"hook": "blocks.0.attn.hook_z", "heads": [1, 1]}, "each head once"),
        ({"hook": "blocks.0.attn.hook_z", "heads": []}, "heads"),
        ({"hook": "blocks.0.attn.hook_z", "heads": [-1]}, "heads"),
    ]:
        with pytest.raises((SpecError, ValueError), match=message):
            parse_request_spec({"interventions": [{**spec, **bad}]})
    with pytest.raises(SpecError, match="Did you mean 'blocks.2.attn.hook_z'"):
        parse_hook_point("blocks.2.attn.hook_zz")


def test_position_scopes_agree_for_blocks_and_single_rows():
    positions = np.arange(8)
    for raw, expected in (("prompt", [0, 1, 2, 3, 4]), ("generated", [5, 6, 7]), ([-1, 0, 6], [0, 4, 6])):
        scope = Scope.resolve(raw, prompt_len=5)
        assert np.nonzero(scope.mask(positions))[0].tolist() == expected  # prefill chunks
        assert [p for p in range(8) if scope.covers(p)] == expected  # decode rows


def test_vector_files_are_checked_and_never_unpickled(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "v.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(4)}, str(good))
    assert load_vector(f"{good}:a", 4).sum() == 4
    with pytest.raises(SpecError, match="holds 2 tensors"):
        load_vector(str(good), 4)
    with pytest.raises(SpecError, match="hidden size is 8"):
        load_vector(f"{good}:a", 8)
    np.save(tmp_path / "nan.npy", np.array([1.0, np.nan, 0.0, 0.0]))
    with pytest.raises(SpecError, match="NaN"):
        load_vector(str(tmp_path / "nan.npy"), 4)
    pickled = tmp_path / "evil.pt"
    torch.save({"v": torch.ones(4), "obj": object()}, pickled)
    with pytest.raises(SpecError, match="needs full unpickling.*refused"):
        load_vector(str(pickled), 4)
    (tmp_path / "broken.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecError, match="cannot read"):
        load_vector(str(tmp_path / "broken.safetensors"), 4)
    with pytest.raises(SpecError, match="not found"):
        load_vector(str(tmp_path / "missing.npy"), 4)


def test_the_bank_evicts_unused_vectors_and_refuses_only_when_all_are_in_use():
    from types import SimpleNamespace

    from inspect_tl_vllm.engine.frontend import Instrumentation

    config = SimpleNamespace(
        architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=4, num_attention_heads=2
    )
    front = Instrumentation(config, InstrumentConfig(max_vectors=2))

    def steered(*vectors):
        spec = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": v} for v in vectors]}
        return front.prepare(parse_request_spec(spec, "x"), prompt_len=3, max_tokens=2)

    first, second = steered([1.0, 0, 0, 0]), steered([0, 1.0, 0, 0])
    upload = front.pending_upload([first, second])
    assert upload is not None and upload.evict == []
    front.hold([first, second], upload)
    assert front.pending_upload([steered([1.0, 0, 0, 0])]) is None  # already there: nothing to send
    third = steered([0, 0, 1.0, 0])
    with pytest.raises(SpecError, match="max_vectors=2"):
        front.pending_upload([third])  # both rows are used by requests in flight
    assert len(front.bank) == 2  # a refused upload changes nothing
    front.release([first])
    front.release([first])  # releasing twice counts once
    upload = front.pending_upload([third])
    assert upload is not None and upload.evict == [next(iter(first.vectors))]
    front.hold([third], upload)
    assert set(front.bank) == {*second.vectors, *third.vectors}
    assert all(users == 1 for users in front.bank.values())
