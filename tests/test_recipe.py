"""te_compile.recipe: formats, per-role dtypes and the validation of every recipe class."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from te_compile.recipe import (
    RECIPES,
    ROLES,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

ALL_RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling,
               NVFP4BlockScaling)


def _qfactory(role):
    return None


# ---- formats -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "fmt, max_fwd, max_bwd",
    [(Format.E4M3, 448.0, 448.0), (Format.E5M2, 57344.0, 57344.0),
     (Format.HYBRID, 448.0, 57344.0), (Format.E2M1, 6.0, 6.0)],
)
def test_format_max(fmt, max_fwd, max_bwd):
    assert fmt.max_fwd == max_fwd
    assert fmt.max_bwd == max_bwd


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2, Format.HYBRID])
def test_format_max_is_torch_finfo_of_its_dtype(fmt):
    # independent of the table in recipe.py: torch knows the largest finite value of each dtype
    assert fmt.max_fwd == torch.finfo(fmt.dtype_for("input")).max
    assert fmt.max_bwd == torch.finfo(fmt.dtype_for("grad_output")).max


@pytest.mark.parametrize(
    "fmt, role, dtype",
    [
        (Format.HYBRID, "input", torch.float8_e4m3fn),
        (Format.HYBRID, "weight", torch.float8_e4m3fn),
        (Format.HYBRID, "output", torch.float8_e4m3fn),
        (Format.HYBRID, "grad_output", torch.float8_e5m2),
        (Format.HYBRID, "grad_input", torch.float8_e5m2),
        (Format.E4M3, "input", torch.float8_e4m3fn),
        (Format.E4M3, "grad_output", torch.float8_e4m3fn),
        (Format.E5M2, "weight", torch.float8_e5m2),
        (Format.E5M2, "grad_input", torch.float8_e5m2),
    ],
)
def test_dtype_for_role(fmt, role, dtype):
    assert fmt.dtype_for(role) is dtype


def test_dtype_for_unknown_role_names_the_roles():
    with pytest.raises(ValueError, match=r"role must be one of .*'input'.*'grad_output'.*got 'bias'"):
        Format.HYBRID.dtype_for("bias")


def test_dtype_for_e2m1_has_no_element_dtype():
    with pytest.raises(ValueError, match="E2M1"):
        Format.E2M1.dtype_for("input")


@pytest.mark.parametrize("name, fmt", [("hybrid", Format.HYBRID), ("E4M3", Format.E4M3),
                                       ("e5m2", Format.E5M2), (Format.E2M1, Format.E2M1)])
def test_format_from_name(name, fmt):
    assert Format.from_name(name) is fmt


def test_format_from_unknown_name_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown format 'E3M4'.*E4M3.*E5M2.*HYBRID.*E2M1"):
        Format.from_name("E3M4")


# ---- valid construction --------------------------------------------------------------------------

@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_defaults_construct_and_are_frozen(cls):
    recipe = cls()
    field = dataclasses.fields(recipe)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, getattr(recipe, field))


def test_defaults_follow_transformer_engine():
    d = DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len) == (0, Format.HYBRID, 1024)
    assert d.amax_compute_algo == "max" and d.reduce_amax is True
    c = Float8CurrentScaling()
    assert (c.fp8_format, c.use_power_2_scales, c.amax_epsilon) == (Format.HYBRID, False, 0.0)
    b = Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert b.use_power_2_scales is True
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    n = NVFP4BlockScaling()
    assert (n.fp4_format, n.fp8_format) == (Format.E2M1, Format.E4M3)


def test_valid_non_defaults_are_accepted():
    algo = lambda history: history.amax()  # noqa: E731
    d = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=1,
                       amax_compute_algo=algo, scaling_factor_compute_algo=lambda *a: a[1])
    assert d.amax_compute_algo is algo and d.margin == 2
    assert DelayedScaling(amax_compute_algo="most_recent").amax_compute_algo == "most_recent"
    assert Float8CurrentScaling(amax_epsilon=1).amax_epsilon == 1  # an int is a valid number
    assert Float8BlockScaling(w_block_scaling_dim=1).w_block_scaling_dim == 1
    assert CustomRecipe(qfactory=_qfactory).qfactory is _qfactory


@pytest.mark.parametrize(
    "recipe, predicate",
    [(DelayedScaling(), "delayed"), (Float8CurrentScaling(), "float8_current_scaling"),
     (MXFP8BlockScaling(), "mxfp8"), (Float8BlockScaling(), "float8_block_scaling"),
     (NVFP4BlockScaling(), "nvfp4"), (CustomRecipe(qfactory=_qfactory), "custom")],
)
def test_exactly_one_kind_predicate_is_true(recipe, predicate):
    kinds = ("delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4", "custom")
    assert [k for k in kinds if getattr(recipe, k)()] == [predicate]
    per_tensor = isinstance(recipe, (DelayedScaling, Float8CurrentScaling))
    assert recipe.float8_per_tensor_scaling() is per_tensor


def test_options_and_registry():
    opts = DelayedScaling(margin=3).options()
    assert opts["margin"] == 3 and opts["fp8_format"] == "HYBRID" and opts["amax_history_len"] == 1024
    assert set(RECIPES) == {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                            "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"}
    assert all(RECIPES[name].__name__ == name for name in RECIPES)
    assert ROLES == ("input", "weight", "output", "grad_output", "grad_input")


# ---- validation errors: each names the field, the allowed values and the bad value ---------------

BAD = [
    # (recipe class, kwargs, field named in the message, fragments naming what is allowed)
    (DelayedScaling, {"amax_compute_algo": "mean"}, "amax_compute_algo", ["'max'", "'most_recent'"]),
    (DelayedScaling, {"margin": -1}, "margin", ["non-negative int"]),
    (DelayedScaling, {"margin": 1.5}, "margin", ["non-negative int"]),
    (DelayedScaling, {"margin": True}, "margin", ["non-negative int"]),
    (DelayedScaling, {"amax_history_len": 0}, "amax_history_len", ["positive int"]),
    (DelayedScaling, {"amax_history_len": True}, "amax_history_len", ["positive int"]),
    (DelayedScaling, {"fp8_format": Format.E5M2}, "fp8_format", ["Format.E4M3", "Format.HYBRID"]),
    (DelayedScaling, {"fp8_format": "HYBRID"}, "fp8_format", ["Format.E4M3", "Format.HYBRID"]),
    (DelayedScaling, {"scaling_factor_compute_algo": 3}, "scaling_factor_compute_algo", ["callable"]),
    (DelayedScaling, {"reduce_amax": 1}, "reduce_amax", ["bool"]),
    (Float8CurrentScaling, {"fp8_format": Format.E5M2}, "fp8_format", ["Format.E4M3", "Format.HYBRID"]),
    (Float8CurrentScaling, {"use_power_2_scales": 1}, "use_power_2_scales", ["bool"]),
    (Float8CurrentScaling, {"amax_epsilon": -1e-3}, "amax_epsilon", ["non-negative float"]),
    (Float8CurrentScaling, {"amax_epsilon": float("nan")}, "amax_epsilon", ["non-negative float"]),
    (Float8CurrentScaling, {"amax_epsilon": float("inf")}, "amax_epsilon", ["finite"]),
    (Float8CurrentScaling, {"amax_epsilon": False}, "amax_epsilon", ["non-negative float"]),
    (MXFP8BlockScaling, {"fp8_format": Format.E5M2}, "fp8_format", ["Format.E4M3", "Format.HYBRID"]),
    (MXFP8BlockScaling, {"fp8_mha": "no"}, "fp8_mha", ["bool"]),
    (Float8BlockScaling, {"x_block_scaling_dim": 2}, "x_block_scaling_dim", ["must be 1"]),
    (Float8BlockScaling, {"grad_block_scaling_dim": 2}, "grad_block_scaling_dim", ["must be 1"]),
    (Float8BlockScaling, {"w_block_scaling_dim": 3}, "w_block_scaling_dim", ["[1, 2]"]),
    (Float8BlockScaling, {"fp8_format": Format.HYBRID}, "fp8_format", ["Format.E4M3"]),
    (Float8BlockScaling, {"amax_epsilon": -1.0}, "amax_epsilon", ["non-negative float"]),
    (NVFP4BlockScaling, {"fp4_format": Format.E4M3}, "fp4_format", ["Format.E2M1"]),
    (NVFP4BlockScaling, {"fp8_format": Format.E5M2}, "fp8_format", ["Format.E4M3"]),
    (NVFP4BlockScaling, {"disable_rht": "yes"}, "disable_rht", ["bool"]),
    (CustomRecipe, {}, "qfactory", ["callable"]),
    (CustomRecipe, {"qfactory": "pkg.mod:factory"}, "qfactory", ["callable"]),
]


@pytest.mark.parametrize("cls, kwargs, field, allowed", BAD,
                         ids=[f"{c.__name__}-{k}" for c, k, _, _ in BAD])
def test_bad_value_names_field_allowed_and_value(cls, kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    msg = str(info.value)
    assert cls.__name__ in msg, msg
    assert field in msg, msg
    for fragment in allowed:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    if kwargs:
        bad = next(iter(kwargs.values()))
        assert repr(bad) in msg, f"the bad value {bad!r} is not in {msg!r}"


def test_block_dim_rejects_bool():
    with pytest.raises(ValueError, match="x_block_scaling_dim"):
        Float8BlockScaling(x_block_scaling_dim=True)


def test_custom_recipe_checks_flags():
    with pytest.raises(ValueError, match="fp8_dpa"):
        CustomRecipe(qfactory=_qfactory, fp8_dpa=1)


def test_message_format_for_choice():
    # the exact form a config loader relays to the user
    with pytest.raises(ValueError, match=re.escape(
            "DelayedScaling.amax_compute_algo must be one of ['max', 'most_recent'], got 'mean'")):
        DelayedScaling(amax_compute_algo="mean")
