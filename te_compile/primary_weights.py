"""FP8 primary weights: ``nn.Linear`` weights (and MoE expert weights) that exist only in their
quantized form.

Inside ``with te_compile.quantized_model_init(recipe=...)`` every ``nn.Linear`` (and subclass) built
holds its weight as a quantized parameter of the recipe's weight format and nothing else: a
``Float8Tensor`` (current or delayed scaling), an ``MXFP8Tensor`` or a ``Float8BlockwiseQTensor``.
A weight of N x K elements then costs N*K bytes instead of 2 or 4 per element. The te backend takes
such a weight as the GEMM operand as it is (gemm/per_tensor.py ``quantize_weight``,
lowerings/linear.py ``_weight_operand``): no second quantization.

Training keeps fp32 master weights in the optimizer (optionally ZeRO-sharded) and writes the new
bytes and scales back with ``te_compile.tensor.utils.cast_master_weights_to_fp8`` after each step.
With ``preserve_high_precision_init_val=True`` each weight keeps, on the CPU, the values it was
quantized from (``weight.get_high_precision_init_val()``), so the master weights start from the
same values an unquantized model would; ``clear_high_precision_init_val()`` frees them.

Delayed scaling: the weight is quantized with the scale the compiled graph keeps for it
(te_compile.state, keyed by this very parameter), and carries the amax of the values it came from
(``Float8Tensor._amax``) for the graph's amax history, as an on-the-fly weight would.

MoE expert weights, the 3-D parameters a module registers inside the block ([E, ...], e.g. HF
Mixtral's ``gate_up_proj``, torchtitan's ``w1``), become ``GroupedFloat8Tensor`` parameters with one
scale per expert under Float8CurrentScaling and DelayedScaling (the block formats keep them in high
precision). A module's own initialization of such a weight in place (``nn.init.normal_``) quantizes
the new values back, expert by expert.

Mechanism: while a context is active, ``nn.Linear.__init__`` is wrapped to convert the weight when
the module is built, and ``nn.Module.register_parameter`` to convert 3-D parameters as they are
registered; the originals are restored when the outermost context exits. Weights whose shape
the recipe's GEMMs cannot take (K or N not a multiple of 16, 32 for MXFP8) and non-float weights stay
in high precision, as the backend would keep those linears.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn as nn

from .config import resolve_config
from .state import load_recipe_state_dict, recipe_state_dict
from .quantization import weight_ineligibility, weight_quantizer
from .recipe import RECIPES, Recipe
from .scaling import quantize_per_expert, tensor_amax
from .tensor.block_scaled_tensor import BlockScaledTensor
from .tensor.float8_tensor import Float8Quantizer
from .tensor.grouped_float8_tensor import GroupedFloat8Tensor
from .tensor.quantized_tensor import QuantizedTensor

__all__ = ["quantized_model_init", "quantize_weights"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Init:
    recipe: Recipe
    keep_init_val: bool


# Active contexts, innermost last; None entries are ``enabled=False`` contexts (they switch it off).
_STACK: list[Optional[_Init]] = []
_ORIGINAL_LINEAR_INIT = nn.Linear.__init__
_ORIGINAL_REGISTER_PARAMETER = nn.Module.register_parameter


def _check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise ValueError(f"quantized_model_init: recipe must be a te_compile.recipe.Recipe, got {recipe!r}")
    if (problem := recipe.primary_weight_problem()) is not None:
        # NVFP4's weight is 16x16-tiled FP4 with a global amax that the master-weight cast does not
        # handle yet
        with_format = [name for name, cls in RECIPES.items() if cls.primary_weights]
        raise ValueError(f"quantized_model_init: {problem}; recipes with one: {with_format}")
    return recipe


def _quantize_linear(linear: nn.Linear, spec: _Init) -> None:
    """Replace ``linear.weight`` by a quantized parameter holding the same values."""
    why = weight_ineligibility(linear.weight, spec.recipe)
    if why is not None:
        log.info("quantized_model_init: %s stays in high precision: %s", type(linear).__name__, why)
        return
    hp = linear.weight.detach()
    requires_grad = linear.weight.requires_grad
    if spec.recipe.delayed() and hp.is_meta:
        # the graph's state would be created on the meta device, and to_empty() replaces the
        # parameter the state is keyed by
        raise ValueError("quantized_model_init: DelayedScaling primary weights cannot be built on the meta "
                         "device yet; build them on the target device (current scaling and the block "
                         "formats can)")
    if spec.recipe.delayed():
        # The state is keyed by the final parameter, so quantize first with scale 1, the scale a new
        # state starts from, then attach the quantizer that reads the graph's scale for it.
        placeholder = Float8Quantizer(torch.ones(1, device=hp.device), torch.zeros(1, device=hp.device),
                                      spec.recipe.fp8_format.dtype_for("weight"), columnwise=False)
        param = nn.Parameter(placeholder.quantize(hp), requires_grad=requires_grad)
        param._quantizer = weight_quantizer(spec.recipe, param, "quantized_model_init")
        param._amax = tensor_amax(hp).reshape(1).to(torch.float32)
    else:
        quantizer = weight_quantizer(spec.recipe)
        value = quantizer.quantize(hp)
        if isinstance(value, BlockScaledTensor):
            # contiguous buffers (the reference quantizer slices ragged tiles off a padded buffer):
            # the master-weight cast and a ZeRO all-gather address them as flat byte ranges
            value = value._map_buffers(torch.Tensor.contiguous)
        param = nn.Parameter(value, requires_grad=requires_grad)
        param._quantizer = quantizer
    if spec.keep_init_val:
        # a meta weight has no values yet: its first initialization after to_empty() fills this
        param._hp_init = [QuantizedTensor.PENDING if hp.is_meta else hp.to("cpu", copy=True)]
    linear.weight = param


def _quantize_experts(param: nn.Parameter, spec: _Init) -> nn.Parameter:
    """An MoE layer's 3-D expert weight [E, ...] as a GroupedFloat8Tensor parameter, one scale per
    expert, or ``param`` itself where the recipe or its shape has no per-expert FP8 form."""
    recipe = spec.recipe
    why = (f"{recipe.name} has no per-expert primary-weight format (Float8CurrentScaling and DelayedScaling "
           f"have)") if not recipe.per_tensor else weight_ineligibility(param[0], recipe)
    if why is not None:
        log.info("quantized_model_init: an expert weight %s stays in high precision: %s", list(param.shape), why)
        return param
    hp = param.detach()
    if recipe.delayed() and hp.is_meta:
        raise ValueError("quantized_model_init: DelayedScaling primary weights cannot be built on the meta "
                         "device yet; build them on the target device (current scaling and the block "
                         "formats can)")
    # delayed scaling: scale 1 first, the scale a new state starts from, as for a linear's weight
    scale = torch.ones(hp.shape[0], device=hp.device) if recipe.delayed() else None
    data, scale_inv, amax = quantize_per_expert(hp, "weight", recipe, scale)
    value = GroupedFloat8Tensor(data=data.view(torch.uint8), scale_inv=scale_inv, fp8_dtype=data.dtype, dtype=hp.dtype,
                                amax=amax if recipe.delayed() else None)
    out = nn.Parameter(value, requires_grad=param.requires_grad)
    # current scaling: the quantizer with the recipe's options (the master-weight cast applies them per
    # expert); delayed: the [E] scales the compiled graph keeps for this very parameter
    out._quantizer = weight_quantizer(recipe, out, "quantized_model_init") if recipe.delayed() else \
        weight_quantizer(recipe)
    if spec.keep_init_val:
        out._hp_init = [QuantizedTensor.PENDING if hp.is_meta else hp.to("cpu", copy=True)]
    return out


def _register_parameter(self, name: str, param) -> None:
    spec = _STACK[-1] if _STACK else None
    if (spec is not None and param is not None and param.dim() == 3 and param.is_floating_point()
            and not isinstance(param, QuantizedTensor)):
        param = _quantize_experts(param, spec)
    _ORIGINAL_REGISTER_PARAMETER(self, name, param)


def _linear_init(self, *args, **kwargs):
    _ORIGINAL_LINEAR_INIT(self, *args, **kwargs)
    spec = _STACK[-1] if _STACK else None
    if spec is not None:
        _quantize_linear(self, spec)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Build ``nn.Linear`` weights as quantized parameters (FP8 primary weights) inside the block.

    recipe: the recipe whose weight format to use; None takes the recipe of the config the te backend
    would resolve (``te_compile.toml``, ``TE_COMPILE_CONFIG``, ...). The te backend must run the same
    recipe on these linears, or it dequantizes the weight first (the report says so).
    preserve_high_precision_init_val: keep each weight's initial values on the CPU
    (``get_high_precision_init_val()``), to initialize fp32 master weights from.
    enabled=False: build high-precision weights (also inside an enabled block).
    """
    spec = None
    if enabled:
        if recipe is None:
            recipe = resolve_config().recipe
            if recipe is None:
                raise ValueError("quantized_model_init: the resolved config runs in high precision "
                                 "(recipe = none); pass a recipe")
        spec = _Init(_check_recipe(recipe), bool(preserve_high_precision_init_val))
    _STACK.append(spec)
    nn.Linear.__init__ = _linear_init
    nn.Module.register_parameter = _register_parameter
    try:
        yield
    finally:
        _STACK.pop()
        if not _STACK:
            nn.Linear.__init__ = _ORIGINAL_LINEAR_INIT
            nn.Module.register_parameter = _ORIGINAL_REGISTER_PARAMETER


def quantize_weights(model: nn.Module, recipe: Optional[Recipe] = None) -> dict[str, str]:
    """Turn the ``nn.Linear`` weights of a model built in high precision into FP8 primary weights, in
    place: for serving, where the high-precision weights are then freed (a model loaded with
    ``from_pretrained``, which replaces the parameters ``quantized_model_init`` would have built).

    Each weight becomes the quantized parameter ``quantized_model_init`` builds, holding the bytes the
    te backend would quantize it to: current scaling from the weight's own amax, the block formats per
    block, delayed scaling with the scale the model's recipe state holds for it (trained or
    ``calibrate``d; a model without state gets scale 1, as a first training step would). The state
    stays the model's: it is carried over to the new parameters.

    Left in high precision, with the reason: weights the recipe's GEMMs cannot take, and weights a
    non-linear module reads too (a head tied to its embedding). A weight several linears share is
    quantized once. MoE expert weights are not linears and stay as they are. Returns
    ``{weight fqn: what was done}``.
    """
    if recipe is None:
        recipe = resolve_config().recipe
        if recipe is None:
            raise ValueError("quantize_weights: the resolved config runs in high precision (recipe = none); "
                             "pass a recipe")
    spec = _Init(_check_recipe(recipe), keep_init_val=False)
    # every (module, attribute) that holds each parameter, so that a shared one is seen whole
    holders: dict[int, list[tuple[str, str, nn.Module, str]]] = {}   # (param fqn, module fqn, module, name)
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((f"{fqn}.{name}" if fqn else name, fqn, module, name))
    saved = recipe_state_dict(model) if recipe.delayed() else {}
    done: dict[str, str] = {}
    converted: list[tuple[nn.Parameter, torch.Tensor]] = []   # delayed scaling: (new weight, its values)
    for entries in holders.values():
        linears = [(f, m) for f, _, m, n in entries if isinstance(m, nn.Linear) and n == "weight"]
        if not linears:
            continue
        (fqn, first), others = linears[0], [(mf, m) for _, mf, m, n in entries
                                            if not (isinstance(m, nn.Linear) and n == "weight")]
        weight = first.weight
        if isinstance(weight, QuantizedTensor):
            done[fqn] = "already quantized"
            continue
        why = (f"{others[0][0]} ({type(others[0][1]).__name__}) reads it too" if others
               else weight_ineligibility(weight, spec.recipe))
        if why is not None:
            done[fqn] = f"kept in high precision: {why}"
            continue
        _quantize_linear(first, spec)
        for _, m in linears[1:]:
            m.weight = first.weight
        if spec.recipe.delayed():
            converted.append((first.weight, weight.detach()))
        done[fqn] = f"FP8 primary weight ({type(first.weight.data).__name__})" + (
            f", shared with {', '.join(f for f, _ in linears[1:])}" if len(linears) > 1 else "")
    if converted:
        # the saved state now keyed by the new parameters; then the bytes made with its weight scales
        load_recipe_state_dict(model, saved, strict=False)
        with torch.no_grad():
            for param, values in converted:
                param.copy_(values)
    return done
