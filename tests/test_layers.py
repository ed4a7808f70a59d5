"""Tests for packfwd.layers: pipeline layer placement against Megatron-Core's own functions.

Strategy: the reference is Megatron-Core itself. For a configuration we build a tiny
``TransformerConfig`` and call ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` for
every (pp_rank, vp_stage), passing the ranks explicitly (neither function then reads
parallel_state). Megatron "accepts" a configuration when the config constructs, both functions
return for every stage, and the ranges they give cover every layer exactly once. For accepted
configurations packfwd must give the same ranges; for every other one packfwd must raise
ValueError. Hypothesis draws configurations twice: uniformly (mostly refused ones) and built from
valid pieces (mostly accepted ones).
"""

from __future__ import annotations

import ast
import itertools
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

import packfwd.layers
from packfwd.layers import LayerOwner, layer_owner, layer_partition

# What Megatron-Core raises for a configuration it refuses: ValueError/AssertionError from config
# validation and the placement functions, ZeroDivisionError/ValueError from init scaling
# (num_layers=0 or negative), ZeroDivisionError from `% vp_size` with vp_size=0 and from the
# offset of pp=2, vpp>1 with both ends set.
MEGATRON_REFUSALS = (ValueError, AssertionError, ZeroDivisionError)


def megatron_config(num_layers, pp, vpp, first, last, *, vpp_none_if_one=True):
    """A tiny TransformerConfig with the given placement; vpp=1 maps to None like Megatron's CLI."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes Megatron emits per config
        return TransformerConfig(
            num_layers=num_layers,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32 if pp > 1 else None,
            virtual_pipeline_model_parallel_size=None if (vpp == 1 and vpp_none_if_one) else vpp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
        )


def megatron_partition(num_layers, pp, vpp, first, last, **kwargs):
    """Megatron-Core's placement as p[pp_rank][vp_stage] ranges, or None if Megatron refuses it."""
    if vpp > 1 and pp == 1:
        # parallel_state.initialize_model_parallel raises RuntimeError("pipeline-model-parallel size
        # should be greater than 1 with interleaved schedule").
        return None
    if pp == 1 and any(x is not None and x != num_layers for x in (first, last)):
        # Documented packfwd deviation: Megatron builds `last` (ignoring a contradicting `first`)
        # on the single stage; packfwd refuses the contradiction.
        return None
    try:
        config = megatron_config(num_layers, pp, vpp, first, last, **kwargs)
        partition = []
        for pp_rank in range(pp):
            chunks = []
            for v in range(vpp):
                vp_stage = v if config.virtual_pipeline_model_parallel_size is not None else None
                count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
                offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
                if count < 0:
                    return None  # Megatron would fail building a negative number of layers
                chunks.append(range(offset, offset + count))
            partition.append(chunks)
    except MEGATRON_REFUSALS:
        return None
    built = sorted(layer for chunks in partition for chunk in chunks for layer in chunk)
    if built != list(range(num_layers)):
        return None  # accepted, but layers would be missing or built twice: a broken model
    return partition


def check_against_megatron(num_layers, pp, vpp, first, last):
    """Assert packfwd agrees with Megatron; return whether Megatron accepted the configuration."""
    expected = megatron_partition(num_layers, pp, vpp, first, last)
    kwargs = dict(first_stage_layers=first, last_stage_layers=last)
    if expected is None:
        with pytest.raises(ValueError):
            layer_partition(num_layers, pp, vpp, **kwargs)
        return False
    assert layer_partition(num_layers, pp, vpp, **kwargs) == expected
    return True


optional_stage = st.one_of(st.none(), st.integers(1, 96))


@given(
    num_layers=st.integers(1, 96),
    pp=st.integers(1, 8),
    vpp=st.integers(1, 4),
    first=optional_stage,
    last=optional_stage,
)
def test_matches_megatron_any_config(num_layers, pp, vpp, first, last):
    check_against_megatron(num_layers, pp, vpp, first, last)


@st.composite
def accepted_configs(draw):
    """(num_layers, pp, vpp, first, last) built so that Megatron-Core accepts it."""
    pp = draw(st.integers(1, 8))
    vpp = draw(st.integers(1, 4)) if pp > 1 else 1
    first = draw(st.one_of(st.none(), st.integers(1, 3).map(lambda k: k * vpp)))
    last = draw(st.one_of(st.none(), st.integers(1, 3).map(lambda k: k * vpp)))
    if pp == 1:  # the single stage is first and last: a given size must be all layers
        num_layers = draw(st.integers(1, 96))
        first = None if first is None else num_layers
        last = None if last is None else num_layers
        return num_layers, pp, vpp, first, last
    if pp == 2 and vpp > 1 and first is not None:
        last = None  # Megatron's offset divides by zero middle stages (see test_pp2_vpp_both_ends)
    middle_stages = pp - (first is not None) - (last is not None)
    per_middle = draw(st.integers(1, 4)) * vpp if middle_stages else 0
    num_layers = (first or 0) + (last or 0) + middle_stages * per_middle
    return num_layers, pp, vpp, first, last


@given(accepted_configs())
def test_matches_megatron_accepted_config(config):
    # The construction aims at configurations Megatron accepts, so this compares real placements.
    assert check_against_megatron(*config), f"Megatron refused {config}"


@given(accepted_configs())
def test_partition_covers_each_layer_once_and_owner_inverts_it(config):
    num_layers, pp, vpp, first, last = config
    kwargs = dict(first_stage_layers=first, last_stage_layers=last)
    p = layer_partition(num_layers, pp, vpp, **kwargs)
    assert len(p) == pp and all(len(chunks) == vpp for chunks in p)
    # Plain loop oracle: walk chunks in round-robin order, they must tile 0..num_layers-1.
    next_layer = 0
    for v in range(vpp):
        for r in range(pp):
            assert p[r][v].start == next_layer and len(p[r][v]) > 0 and p[r][v].step == 1
            next_layer = p[r][v].stop
    assert next_layer == num_layers
    for layer in range(num_layers):
        owner = layer_owner(layer, num_layers, pp, vpp, **kwargs)
        assert isinstance(owner, LayerOwner)
        assert p[owner.pp_rank][owner.vpp_rank][owner.local_index] == layer
    for bad in (-1, num_layers):
        with pytest.raises(ValueError, match="layer"):
            layer_owner(bad, num_layers, pp, vpp, **kwargs)


@pytest.mark.parametrize("num_layers, pp", [(8, 2), (24, 4), (12, 3)])
def test_vpp_one_matches_megatron_explicit_vpp_one(num_layers, pp):
    # packfwd's vpp=1 must equal both Megatron spellings: None and an explicit 1.
    explicit = megatron_partition(num_layers, pp, 1, None, None, vpp_none_if_one=False)
    assert explicit is not None
    assert layer_partition(num_layers, pp, 1) == explicit


def test_megatron_docstring_examples():
    # Hand-copied from the comment in Megatron-Core's get_num_layers_to_build.
    assert layer_partition(8, pp=2, vpp=4) == [
        [range(0, 1), range(2, 3), range(4, 5), range(6, 7)],
        [range(1, 2), range(3, 4), range(5, 6), range(7, 8)],
    ]
    assert layer_partition(8, pp=2, vpp=2) == [
        [range(0, 2), range(4, 6)],
        [range(2, 4), range(6, 8)],
    ]


def test_uneven_interleaved_by_hand():
    # 2 + 3*4 + 2 layers; first/last ranks have 1-layer chunks, middle ranks 2-layer chunks.
    p = layer_partition(16, pp=5, vpp=2, first_stage_layers=2, last_stage_layers=2)
    assert p == [
        [range(0, 1), range(8, 9)],
        [range(1, 3), range(9, 11)],
        [range(3, 5), range(11, 13)],
        [range(5, 7), range(13, 15)],
        [range(7, 8), range(15, 16)],
    ]
    assert layer_owner(12, 16, 5, 2, first_stage_layers=2, last_stage_layers=2) == (2, 1, 1)
    assert layer_owner(15, 16, 5, 2, first_stage_layers=2, last_stage_layers=2) == (4, 1, 0)


def test_pp2_vpp_both_ends_fails_in_megatron_and_has_an_equivalent():
    # Megatron-Core accepts the config but its layer offset divides by the zero middle stages.
    config = megatron_config(6, 2, 2, 2, 4)
    with pytest.raises(ZeroDivisionError):
        get_transformer_layer_offset(config, vp_stage=0, pp_rank=1)
    with pytest.raises(ValueError, match="only first_stage_layers=2"):
        layer_partition(6, 2, 2, first_stage_layers=2, last_stage_layers=4)
    # The placement the error message suggests instead.
    assert layer_partition(6, 2, 2, first_stage_layers=2) == megatron_partition(6, 2, 2, 2, None)
    assert layer_partition(6, 2, 2, first_stage_layers=2) == [
        [range(0, 1), range(3, 4)],
        [range(1, 3), range(4, 6)],
    ]


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((0, 1), {}, "num_layers"),
        ((8, 0), {}, "pp"),
        ((8, 2, 0), {}, "vpp"),
        ((8, 1, 2), {}, "vpp"),
        ((10, 4), {}, "num_layers"),
        ((8, 2, 3), {}, "vpp"),
        ((8, 2), {"first_stage_layers": 0}, "first_stage_layers"),
        ((8, 2), {"last_stage_layers": -1}, "last_stage_layers"),
        ((8, 2, 2), {"first_stage_layers": 3}, "first_stage_layers"),
        ((8, 2), {"first_stage_layers": 3, "last_stage_layers": 3}, "first_stage_layers"),
        ((8, 3), {"first_stage_layers": 4, "last_stage_layers": 4}, "first_stage_layers"),
        ((9, 4), {"first_stage_layers": 2}, "first_stage_layers"),
        ((10, 4, 2), {"first_stage_layers": 2, "last_stage_layers": 2}, "vpp"),
        ((8, 1), {"first_stage_layers": 4}, "first_stage_layers"),
        ((4, 2, 2), {"first_stage_layers": 2, "last_stage_layers": 2}, "last_stage_layers"),
    ],
)
def test_errors_name_the_argument(args, kwargs, name):
    num_layers, pp, vpp = (*args, 1)[:3]
    first, last = kwargs.get("first_stage_layers"), kwargs.get("last_stage_layers")
    assert megatron_partition(num_layers, pp, vpp, first, last) is None  # Megatron refuses it too
    with pytest.raises(ValueError, match=name):
        layer_partition(*args, **kwargs)


def test_the_vpp_an_error_suggests_is_accepted():
    """The uneven split's vpp errors suggested the divisors of one stage's share: layer_partition(14, 4, 2,
    first_stage_layers=2, last_stage_layers=2) said "pick vpp from [1, 5]", and vpp=5 is refused for the first
    stage's 2 layers (so is vpp=3 of "first_stage_layers=3 ... vpp from [1, 3]" where the middle stages get 2 each).
    Every vpp an error suggests now places the model, here and in Megatron-Core."""
    suggested = 0
    for num_layers, pp, vpp in itertools.product(range(1, 25), range(2, 6), range(2, 5)):
        for first, last in itertools.product([None, *range(1, 9)], repeat=2):
            try:
                layer_partition(num_layers, pp, vpp, first_stage_layers=first, last_stage_layers=last)
                continue
            except ValueError as error:
                message = str(error)
            found = re.search(r"vpp from (\[[\d, ]+\])", message)
            for choice in ast.literal_eval(found[1]) if found else []:
                expected = megatron_partition(num_layers, pp, choice, first, last)
                assert expected is not None, (num_layers, pp, vpp, first, last, message)
                assert layer_partition(num_layers, pp, choice, first_stage_layers=first,
                                       last_stage_layers=last) == expected
                suggested += 1
    assert suggested > 100


@pytest.mark.parametrize("bad", [2.0, "4", True, None])
def test_non_int_is_type_error(bad):
    with pytest.raises(TypeError, match="num_layers"):
        layer_partition(bad, 1)


def test_module_imports_neither_torch_nor_megatron():
    tree = ast.parse(Path(packfwd.layers.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"torch", "megatron"}, imported
