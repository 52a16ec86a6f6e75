"""te_compile.config: the TOML schema, the source precedence and the error messages."""

from __future__ import annotations

import re
import textwrap

import pytest

from te_compile.config import (
    ConfigError,
    Override,
    RewriteConfig,
    TeConfig,
    config_from_dict,
    load_config,
    resolve_config,
)
from te_compile.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """An empty working directory and no TE_COMPILE_CONFIG, so only the sources a test writes count."""
    monkeypatch.delenv("TE_COMPILE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def qfactory_module(tmp_path, monkeypatch):
    """A user module with a quantizer factory, importable as ``my_quant``."""
    write(tmp_path / "my_quant.py", """
        def factory(role):
            return ("quantizer", role)

        def history_max(amax_history):
            return amax_history.max()

        NOT_CALLABLE = 3
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_quant
    return my_quant


# ------------------------------------------------------------------------------------------------
# Defaults and the full schema


def test_defaults(clean_env):
    config = resolve_config()
    assert config == TeConfig()
    assert config.recipe == Float8CurrentScaling()
    assert config.rewrite == RewriteConfig(linear=True, layer_norm=True, rms_norm=True, sdpa=False)
    assert config.overrides == ()
    assert config.compiler == "inductor"
    assert config.native_block_gemm is True
    assert config.source == "<defaults>"
    assert config.recipe_for("layers.0.attn.qkv") == (Float8CurrentScaling(), "global")


def test_full_file_every_key(tmp_path):
    path = write(tmp_path / "fp8.toml", """
        recipe = "DelayedScaling"
        compiler = "aot_eager"
        native_block_gemm = false
        [recipe_options]
        margin = 1
        fp8_format = "E4M3"
        amax_history_len = 16
        amax_compute_algo = "most_recent"
        reduce_amax = false
        fp8_dpa = true
        fp8_mha = false
        [rewrite]
        linear = true
        layer_norm = false
        rms_norm = false
        sdpa = true
        [[overrides]]
        modules = "lm_head"
        recipe = "none"
        [[overrides]]
        modules = "layers.*.mlp.*"
        recipe = "MXFP8BlockScaling"
        recipe_options = { fp8_format = "HYBRID" }
    """)
    config = load_config(path)
    assert config.recipe == DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=16,
                                           amax_compute_algo="most_recent", reduce_amax=False,
                                           fp8_dpa=True)
    assert config.rewrite == RewriteConfig(linear=True, layer_norm=False, rms_norm=False, sdpa=True)
    assert config.overrides == (
        Override("lm_head", None),
        Override("layers.*.mlp.*", MXFP8BlockScaling(fp8_format=Format.HYBRID)),
    )
    assert config.compiler == "aot_eager"
    assert config.native_block_gemm is False
    assert config.source == str(path)


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("DelayedScaling", {"margin": 2, "amax_history_len": 4},
         DelayedScaling(margin=2, amax_history_len=4)),
        ("Float8CurrentScaling", {"use_power_2_scales": True, "amax_epsilon": 1},
         Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1.0)),
        ("MXFP8BlockScaling", {"fp8_format": "HYBRID"}, MXFP8BlockScaling(fp8_format=Format.HYBRID)),
        ("Float8BlockScaling", {"w_block_scaling_dim": 1, "use_power_2_scales": False},
         Float8BlockScaling(w_block_scaling_dim=1, use_power_2_scales=False)),
        ("NVFP4BlockScaling", {"disable_rht": True, "fp4_format": "E2M1"},
         NVFP4BlockScaling(disable_rht=True)),
    ],
)
def test_each_recipe_by_name(name, options, expected):
    config = config_from_dict({"recipe": name, "recipe_options": options}, "test")
    assert type(config.recipe).__name__ == name
    assert config.recipe == expected


def test_float_option_given_as_int_becomes_float():
    config = config_from_dict({"recipe": "Float8CurrentScaling", "recipe_options": {"amax_epsilon": 1}}, "t")
    assert isinstance(config.recipe.amax_epsilon, float)


@pytest.mark.parametrize("spelling", ["none", "None"])
def test_recipe_none(spelling):
    config = config_from_dict({"recipe": spelling}, "t")
    assert config.recipe is None
    assert config.recipe_for("anything") == (None, "global")


@pytest.mark.parametrize("name", ["E4M3", "HYBRID", "hybrid"])
def test_format_names(name):
    config = config_from_dict({"recipe": "Float8CurrentScaling",
                               "recipe_options": {"fp8_format": name}}, "t")
    assert config.recipe.fp8_format is Format[name.upper()]


def test_custom_recipe_qfactory_import(tmp_path, qfactory_module):
    path = write(tmp_path / "custom.toml", """
        recipe = "CustomRecipe"
        [recipe_options]
        qfactory = "my_quant:factory"
    """)
    config = load_config(path)
    assert isinstance(config.recipe, CustomRecipe)
    assert config.recipe.qfactory is qfactory_module.factory
    assert config.recipe.qfactory("weight") == ("quantizer", "weight")


def test_callable_field_import(qfactory_module):
    config = config_from_dict({"recipe": "DelayedScaling",
                               "recipe_options": {"amax_compute_algo": "my_quant:history_max",
                                                  "scaling_factor_compute_algo": "my_quant:factory"}}, "t")
    assert config.recipe.amax_compute_algo is qfactory_module.history_max
    assert config.recipe.scaling_factor_compute_algo is qfactory_module.factory


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("my_quant", r"expected a callable or a 'package\.module:function' string"),
        ("my_quant:", r"expected 'package\.module:function'"),
        ("no_such_module_xyz:factory", r"cannot import module 'no_such_module_xyz'"),
        ("my_quant:missing", r"module 'my_quant' has no attribute 'missing'"),
        ("my_quant:NOT_CALLABLE", r"'my_quant:NOT_CALLABLE' is not callable"),
    ],
)
def test_custom_recipe_qfactory_errors(tmp_path, qfactory_module, spec, problem):
    path = write(tmp_path / "custom.toml", f"""
        recipe = "CustomRecipe"
        recipe_options = {{ qfactory = "{spec}" }}
    """)
    with pytest.raises(ConfigError, match=rf"custom\.toml: recipe_options\.qfactory: {problem}"):
        load_config(path)


# ------------------------------------------------------------------------------------------------
# Overrides


def test_overrides_first_match_wins():
    config = config_from_dict({
        "recipe": "DelayedScaling",
        "overrides": [
            {"modules": "lm_head", "recipe": "none"},
            {"modules": "layers.0.*", "recipe": "Float8CurrentScaling"},
            {"modules": "layers.*.mlp.*", "recipe": "MXFP8BlockScaling"},
        ],
    }, "t")
    assert config.recipe_for("lm_head") == (None, "override 'lm_head'")
    # layers.0.mlp.fc1 matches both later globs: the earlier one wins
    assert config.recipe_for("layers.0.mlp.fc1") == (Float8CurrentScaling(), "override 'layers.0.*'")
    assert config.recipe_for("layers.3.mlp.fc1") == (MXFP8BlockScaling(), "override 'layers.*.mlp.*'")
    assert config.recipe_for("layers.3.attn.qkv") == (DelayedScaling(), "global")
    # globs are case-sensitive and anchored at both ends
    assert config.recipe_for("LM_HEAD") == (DelayedScaling(), "global")
    assert config.recipe_for("model.lm_head") == (DelayedScaling(), "global")


def test_same_recipe_override_inherits_global_options():
    config = config_from_dict({
        "recipe": "DelayedScaling",
        "recipe_options": {"amax_history_len": 16, "margin": 1},
        "overrides": [
            {"modules": "a", "recipe": "DelayedScaling"},
            {"modules": "b", "recipe": "DelayedScaling", "recipe_options": {"margin": 3}},
        ],
    }, "t")
    assert config.recipe_for("a")[0] == DelayedScaling(amax_history_len=16, margin=1)
    # own recipe_options: defaults + its own, nothing inherited
    assert config.recipe_for("b")[0] == DelayedScaling(margin=3)


def test_different_recipe_override_does_not_inherit():
    config = config_from_dict({
        "recipe": "Float8CurrentScaling",
        "recipe_options": {"fp8_format": "E4M3"},
        "overrides": [{"modules": "x", "recipe": "DelayedScaling"}],
    }, "t")
    assert config.recipe_for("x")[0] == DelayedScaling()


# ------------------------------------------------------------------------------------------------
# Sources and their precedence


def test_pyproject_table_beats_defaults(clean_env):
    write(clean_env / "pyproject.toml", """
        [project]
        name = "x"
        [tool.te_compile]
        recipe = "MXFP8BlockScaling"
    """)
    config = resolve_config()
    assert config.recipe == MXFP8BlockScaling()
    assert config.source.endswith("pyproject.toml [tool.te_compile]")


def test_pyproject_without_table_gives_defaults(clean_env):
    write(clean_env / "pyproject.toml", """
        [project]
        name = "x"
    """)
    assert resolve_config() == TeConfig()


def test_local_file_beats_pyproject(clean_env):
    write(clean_env / "pyproject.toml", '[tool.te_compile]\nrecipe = "MXFP8BlockScaling"\n')
    write(clean_env / "te_compile.toml", 'recipe = "DelayedScaling"\n')
    config = resolve_config()
    assert config.recipe == DelayedScaling()
    assert config.source == str(clean_env / "te_compile.toml")


def test_env_beats_local_file(clean_env, monkeypatch):
    write(clean_env / "te_compile.toml", 'recipe = "DelayedScaling"\n')
    write(clean_env / "env.toml", 'recipe = "Float8BlockScaling"\n')
    monkeypatch.setenv("TE_COMPILE_CONFIG", "env.toml")
    config = resolve_config()
    assert config.recipe == Float8BlockScaling()
    assert config.source == "TE_COMPILE_CONFIG=env.toml"


def test_options_beat_env(clean_env, monkeypatch):
    write(clean_env / "env.toml", 'recipe = "Float8BlockScaling"\n')
    monkeypatch.setenv("TE_COMPILE_CONFIG", "env.toml")
    config = resolve_config({"recipe": "none"})
    assert config.recipe is None
    assert config.source == "options"
    # no merging across sources: the env file's recipe is not consulted at all
    assert resolve_config({"compiler": "aot_eager"}).recipe == Float8CurrentScaling()


@pytest.mark.parametrize("options", [None, {}])
def test_empty_options_count_as_absent(clean_env, options):
    write(clean_env / "te_compile.toml", 'recipe = "DelayedScaling"\n')
    assert resolve_config(options).recipe == DelayedScaling()


def test_cwd_argument(clean_env, tmp_path_factory):
    other = tmp_path_factory.mktemp("project")
    write(other / "te_compile.toml", 'recipe = "NVFP4BlockScaling"\n')
    write(other / "fp8.toml", 'recipe = "DelayedScaling"\n')
    assert resolve_config(cwd=other).recipe == NVFP4BlockScaling()
    assert resolve_config({"config": "fp8.toml"}, cwd=other).recipe == DelayedScaling()
    assert resolve_config() == TeConfig()  # the process's cwd has neither file


# ------------------------------------------------------------------------------------------------
# Inline options


def test_inline_flat_recipe_keys(clean_env):
    config = resolve_config({"recipe": "DelayedScaling", "amax_history_len": 16, "fp8_format": "E4M3"})
    assert config.recipe == DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3)


def test_inline_flat_key_for_default_recipe(clean_env):
    config = resolve_config({"use_power_2_scales": True})
    assert config.recipe == Float8CurrentScaling(use_power_2_scales=True)


def test_inline_python_objects(clean_env, qfactory_module):
    config = resolve_config({
        "recipe": DelayedScaling(margin=2),
        "fp8_format": Format.E4M3,
        "amax_compute_algo": qfactory_module.history_max,
        "rewrite": {"sdpa": True},
    })
    assert config.recipe == DelayedScaling(margin=2, fp8_format=Format.E4M3,
                                           amax_compute_algo=qfactory_module.history_max)
    assert config.rewrite.sdpa is True


def test_inline_unknown_flat_key_lists_both_sets(clean_env):
    with pytest.raises(ConfigError, match=r"options: amax_histroy_len: unknown option") as info:
        resolve_config({"recipe": "DelayedScaling", "amax_histroy_len": 16})
    message = str(info.value)
    assert "'recipe_options'" in message and "'compiler'" in message  # top-level keys
    assert "'amax_history_len'" in message and "'margin'" in message  # DelayedScaling fields


def test_config_file_with_inline_layering(clean_env):
    write(clean_env / "fp8.toml", """
        recipe = "DelayedScaling"
        compiler = "aot_eager"
        native_block_gemm = false
        [recipe_options]
        margin = 1
        amax_history_len = 1024
        [rewrite]
        sdpa = true
        [[overrides]]
        modules = "lm_head"
        recipe = "none"
    """)
    config = resolve_config({"config": "fp8.toml", "amax_history_len": 16,
                             "recipe_options": {"fp8_format": "E4M3"}, "rewrite": {"linear": False}})
    # recipe_options merge key by key (margin kept from the file) ...
    assert config.recipe == DelayedScaling(margin=1, amax_history_len=16, fp8_format=Format.E4M3)
    # ... other keys replace the file's value whole (the file's sdpa = true is gone)
    assert config.rewrite == RewriteConfig(linear=False)
    assert config.compiler == "aot_eager"
    assert config.overrides == (Override("lm_head", None),)
    assert config.source == "options[config]=fp8.toml"


def test_inline_recipe_change_drops_file_recipe_options(clean_env):
    write(clean_env / "fp8.toml", 'recipe = "DelayedScaling"\nrecipe_options = { margin = 1 }\n')
    config = resolve_config({"config": "fp8.toml", "recipe": "MXFP8BlockScaling"})
    assert config.recipe == MXFP8BlockScaling()


# ------------------------------------------------------------------------------------------------
# Error messages: source, key path, allowed values


@pytest.fixture
def error_for(tmp_path, monkeypatch):
    """The ConfigError message of loading ``text`` as ./bad.toml (relative, so messages are short)."""
    monkeypatch.chdir(tmp_path)

    def load(text: str) -> str:
        write(tmp_path / "bad.toml", text)
        with pytest.raises(ConfigError) as info:
            load_config("bad.toml")
        return str(info.value)

    return load


def test_error_unknown_top_level_key(error_for):
    message = error_for('recipe = "DelayedScaling"\nrecipes = "x"\n')
    assert re.search(r"bad\.toml: recipes: unknown key; allowed keys: \['recipe', 'recipe_options', "
                     r"'rewrite', 'overrides', 'compiler', 'native_block_gemm', 'combo_kernels', "
                     r"'cache_fp8_weights', 'distributed', "
                     r"'amax_group', 'mesh', 'inference', 'memory'\]", message), message


def test_error_unknown_recipe_name(error_for):
    message = error_for('recipe = "delayedscaling"\n')
    assert "bad.toml: recipe: unknown recipe 'delayedscaling'" in message
    assert "did you mean 'DelayedScaling'?" in message
    for allowed in ("'DelayedScaling'", "'MXFP8BlockScaling'", "'CustomRecipe'", "'none'"):
        assert allowed in message


def test_error_unknown_recipe_option(error_for):
    message = error_for('recipe = "MXFP8BlockScaling"\n[recipe_options]\nmargin = 0\n')
    assert message == ("bad.toml: recipe_options.margin: unknown option of MXFP8BlockScaling; "
                       "allowed: ['fp8_format', 'fp8_dpa', 'fp8_mha', 'fp8_dpa_backward']")


def test_fp8_dpa_backward_in_recipe_options_and_overrides(tmp_path):
    path = write(tmp_path / "attn.toml", """
        recipe = "Float8CurrentScaling"
        [recipe_options]
        fp8_dpa = true
        fp8_dpa_backward = "fp8"
        [[overrides]]
        modules = "layers.0.*"
        recipe = "DelayedScaling"
        recipe_options = { fp8_dpa = true }
    """)
    config = load_config(path)
    assert config.recipe == Float8CurrentScaling(fp8_dpa=True, fp8_dpa_backward="fp8")
    assert config.recipe_for("layers.0.attn")[0].fp8_dpa_backward == "high_precision"   # the default
    assert resolve_config({"recipe": "MXFP8BlockScaling", "fp8_dpa_backward": "fp8"}).recipe.fp8_dpa_backward == "fp8"


def test_error_fp8_dpa_backward_value(error_for):
    message = error_for('recipe = "DelayedScaling"\n[recipe_options]\nfp8_dpa_backward = "bf16"\n')
    assert message == ("bad.toml: recipe_options: DelayedScaling.fp8_dpa_backward must be one of "
                       "['high_precision', 'fp8'], got 'bf16'"), message


@pytest.mark.parametrize(
    "line, key, expected",
    [
        ('amax_history_len = "16"', "amax_history_len", r"expected an int, got '16' \(str\)"),
        ("margin = true", "margin", r"expected an int, got True \(bool\)"),
        ("reduce_amax = 1", "reduce_amax", r"expected a bool \(true or false\), got 1 \(int\)"),
    ],
)
def test_error_wrong_type(tmp_path, line, key, expected):
    path = write(tmp_path / "bad.toml", f'recipe = "DelayedScaling"\n[recipe_options]\n{line}\n')
    with pytest.raises(ConfigError, match=rf"bad\.toml: recipe_options\.{key}: {expected}"):
        load_config(path)


def test_error_native_block_gemm_type(tmp_path):
    path = write(tmp_path / "bad.toml", 'native_block_gemm = "no"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: native_block_gemm: expected a bool \(true or false\), "
                                          r"got 'no' \(str\)"):
        load_config(path)


def test_combo_kernels_key_reaches_inductor(tmp_path, monkeypatch):
    """``combo_kernels = true`` is a bool read from the file (a string is an error naming the key) and
    becomes inductor's ``combo_kernels`` patch for te's graphs (inductor itself leaves CPU nodes out of
    combo kernels); the default adds none."""
    import importlib

    import torch
    import torch._inductor.compile_fx as compile_fx_module

    te_backend = importlib.import_module("te_compile.backend")   # the package's ``backend`` is the function

    path = write(tmp_path / "bad.toml", 'combo_kernels = "yes"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: combo_kernels: expected a bool"):
        load_config(path)
    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs, **kw: seen.append(kw["config_patches"]))
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    on = load_config(write(tmp_path / "on.toml", "combo_kernels = true\n"))
    assert on.combo_kernels is True and load_config(write(tmp_path / "off.toml", "")).combo_kernels is False
    for config in (on, load_config(tmp_path / "off.toml")):
        te_backend._final_compiler(gm, [torch.empty(2)], config, None)
    assert [p.get("combo_kernels") for p in seen] == [True, None], seen


def test_error_wrong_float_type(tmp_path):
    path = write(tmp_path / "bad.toml", 'recipe_options = { amax_epsilon = "0.1" }\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: recipe_options\.amax_epsilon: expected a float"):
        load_config(path)


def test_error_recipe_value_check_keeps_recipe_message(tmp_path):
    path = write(tmp_path / "bad.toml", 'recipe = "DelayedScaling"\nrecipe_options = { margin = -1 }\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: recipe_options: DelayedScaling\.margin must be "
                                          r"a non-negative int, got -1"):
        load_config(path)


def test_error_bad_format_name(tmp_path):
    path = write(tmp_path / "bad.toml", 'recipe = "DelayedScaling"\nrecipe_options = { fp8_format = "E3M4" }\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: recipe_options\.fp8_format: unknown format 'E3M4'; "
                                          r"allowed: \['E4M3', 'E5M2', 'HYBRID', 'E2M1'\]"):
        load_config(path)


def test_error_format_not_allowed_by_recipe(tmp_path):
    path = write(tmp_path / "bad.toml", 'recipe = "DelayedScaling"\nrecipe_options = { fp8_format = "E5M2" }\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: recipe_options: DelayedScaling\.fp8_format must be "
                                          r"one of \['Format\.E4M3', 'Format\.HYBRID'\]"):
        load_config(path)


@pytest.mark.parametrize(
    "modules, problem",
    [
        ('"layers.[0-3.mlp"', r"glob 'layers\.\[0-3\.mlp' has a '\[' at position 7 without a closing '\]'"),
        ('""', r"must be a non-empty glob string"),
        ('["a", "b"]', r"must be a single glob string \(write one \[\[overrides\]\] table per glob\)"),
        ("3", r"must be a single glob string"),
    ],
)
def test_error_bad_glob(tmp_path, modules, problem):
    path = write(tmp_path / "bad.toml", f'[[overrides]]\nmodules = "x"\nrecipe = "none"\n'
                                        f'[[overrides]]\nmodules = {modules}\nrecipe = "none"\n')
    with pytest.raises(ConfigError, match=rf"bad\.toml: overrides\[1\]\.modules: {problem}"):
        load_config(path)


def test_valid_bracket_globs():
    config = config_from_dict({"overrides": [{"modules": "layers.[0-3].mlp", "recipe": "none"},
                                             {"modules": "[]x]", "recipe": "none"}]}, "t")
    assert config.recipe_for("layers.2.mlp") == (None, "override 'layers.[0-3].mlp'")
    assert config.recipe_for("layers.7.mlp")[1] == "global"


def test_error_override_keys(error_for):
    message = error_for('[[overrides]]\nmodules = "x"\nrecipe = "none"\nprecision = "bf16"\n')
    assert message == ("bad.toml: overrides[0].precision: unknown key; "
                       "allowed keys: ['modules', 'recipe', 'recipe_options', 'offload_activations']")
    message = error_for('[[overrides]]\nrecipe = "none"\n')
    assert message.startswith("bad.toml: overrides[0].modules: missing required key")
    assert "['modules', 'recipe', 'recipe_options', 'offload_activations']" in message


def test_error_override_recipe(tmp_path, error_for):
    message = error_for('[[overrides]]\nmodules = "x"\nrecipe = "MXFP8"\n')
    assert "bad.toml: overrides[0].recipe: unknown recipe 'MXFP8'" in message
    assert "'MXFP8BlockScaling'" in message
    path = write(tmp_path / "bad.toml", '[[overrides]]\nmodules = "x"\nrecipe = "DelayedScaling"\n'
                                        'recipe_options = { amax_history_len = 0 }\n')
    with pytest.raises(ConfigError, match=r"overrides\[0\]\.recipe_options: DelayedScaling\.amax_history_len"):
        load_config(path)


def test_error_unknown_rewrite_key(error_for):
    message = error_for("[rewrite]\nattention = true\n")
    assert message == ("bad.toml: rewrite.attention: unknown key; "
                       "allowed keys: ['linear', 'grouped_linear', 'layer_norm', 'rms_norm', 'activation', 'sdpa', "
                       "'linear_cross_entropy', 'linear_cross_entropy_chunk', 'small_gemms']")
    message = error_for('[rewrite]\nsdpa = "yes"\n')
    assert message.startswith("bad.toml: rewrite.sdpa: expected a bool")


def test_expert_amax_group_loads_and_names_the_allowed_groups(tmp_path, error_for):
    config = load_config(write(tmp_path / "ep.toml", '[distributed]\nexpert_amax_group = "none"\n'))
    assert config.distributed.expert_amax_group == "none" and config.distributed.amax_group == "auto"
    assert load_config(write(tmp_path / "d.toml", "")).distributed.expert_amax_group == "same"
    message = error_for('[distributed]\nexpert_amax_group = "experts"\n')
    assert message == ("bad.toml: distributed.expert_amax_group: unknown amax group 'experts'; allowed: "
                       "['same', 'auto', 'world', 'none'], a list of mesh dim names, or from Python a "
                       "ProcessGroup or a DeviceMesh")


def test_error_bad_compiler(error_for):
    message = error_for('compiler = "eager"\n')
    assert message == "bad.toml: compiler: must be one of ['inductor', 'aot_eager'], got 'eager'"


def test_error_recipe_options_with_recipe_none(tmp_path, error_for):
    message = error_for('recipe = "none"\n[recipe_options]\nmargin = 0\n')
    assert message.startswith("bad.toml: recipe_options: recipe is 'none' (high precision), which takes "
                              "no options")
    path = write(tmp_path / "o.toml", '[[overrides]]\nmodules = "x"\nrecipe = "none"\n'
                                      'recipe_options = { margin = 0 }\n')
    with pytest.raises(ConfigError, match=r"o\.toml: overrides\[0\]\.recipe_options: "):
        load_config(path)


def test_error_toml_syntax(error_for):
    message = error_for('recipe = "DelayedScaling\n')
    assert message.startswith("bad.toml: invalid TOML: ")
    assert "(at line 1, column 25)" in message  # tomllib's own message says where


def test_error_missing_file(tmp_path, clean_env, monkeypatch):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(missing))}: config file not found$"):
        load_config(missing)
    resolved = re.escape(f"({missing})")
    with pytest.raises(ConfigError, match=rf"^options\[config\]=nope\.toml: config file not found {resolved}"):
        resolve_config({"config": "nope.toml"})
    monkeypatch.setenv("TE_COMPILE_CONFIG", "nope.toml")
    with pytest.raises(ConfigError, match=rf"^TE_COMPILE_CONFIG=nope\.toml: config file not found {resolved}"):
        resolve_config()


def test_error_in_env_file_names_env_var(clean_env, monkeypatch):
    write(clean_env / "env.toml", 'compiler = "tvm"\n')
    monkeypatch.setenv("TE_COMPILE_CONFIG", "env.toml")
    with pytest.raises(ConfigError, match=r"^TE_COMPILE_CONFIG=env\.toml: compiler: must be one of"):
        resolve_config()


def test_error_inline_options_source():
    with pytest.raises(ConfigError, match=r"^options: recipe_options\.margin: expected an int"):
        resolve_config({"recipe": "DelayedScaling", "margin": 0.5})
    with pytest.raises(ConfigError, match=r"^options: margin: unknown option.*recipe 'none' has no fields"):
        resolve_config({"recipe": "none", "margin": 0})


def test_teconfig_validates_direct_construction():
    with pytest.raises(ValueError, match=r"TeConfig\.compiler must be one of"):
        TeConfig(compiler="eager")
    with pytest.raises(ValueError, match=r"Override\.modules must be a single glob string"):
        Override(["a"], None)
    assert TeConfig(overrides=[Override("a", None)]).overrides == (Override("a", None),)


def test_every_example_config_loads_and_builds_a_supported_lowering():
    """The shipped examples/*.toml parse, and every recipe they name has a lowering."""
    from pathlib import Path

    from te_compile.lowerings import LinearLowering, LinearSpec
    from te_compile.gemm.block import quantizer_factory

    paths = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))
    assert len(paths) >= 8, [p.name for p in paths]
    for path in paths:
        config = load_config(path)
        recipes = [config.recipe] + [o.recipe for o in config.overrides]
        for recipe in recipes:
            if recipe is not None:
                LinearLowering(LinearSpec("fc", recipe))
                # per-tensor recipes quantize in the lowering; the others through quantizer objects
                assert recipe.per_tensor or quantizer_factory(recipe)("weight") is not None, (path.name, recipe)
