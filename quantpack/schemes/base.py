"""The :class:`Scheme` record: everything quantpack knows about one quantization scheme, in one place."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

# (module name, the nn.Linear (or Conv1D, see modules.linear.linear_dims) being replaced (on meta), the validated
# quantization_config, the compute dtype) -> the replacement module on the meta device. Its state-dict keys are
# the tensor names the checkpoint stores for that module.
ModuleBuilder = Callable[[str, nn.Module, dict, torch.dtype], nn.Module]


@dataclass(frozen=True)
class ModuleCheck:
    """How ``verify`` checks the modules of a scheme's module class.

    * ``layout(module)``: the fields besides (out, in) features and dtype that select a kernel
      (bits, group size, ...); modules with equal shape, dtype and layout are kernel-checked once.
    * ``dequantize(module)``: the (N, K) float32 weight the module represents.
    * ``oracle(module, x)``: the float32 result its forward must match.
    * ``tolerance(module, dtype)``: the largest relative error of the forward (in ``dtype``).
    * ``locate(read, name, module, reference_weight, settings)``: which of the module's stored
      tensors differ from what converting ``reference_weight`` with the manifest's ``settings``
      would have stored: a list of (tensor name, reason). ``read(tensor_name)`` returns a stored
      tensor; ``module`` is the module as the loader builds it, on the meta device (its layout
      without data). ``None``: the scheme cannot tell, and the file is named instead.
    * ``stored_dtypes``: floating-point tensors the scheme always stores in one dtype, by
      state-dict key (W8A8's float32 ``weight_scale``); other floating-point tensors must have
      the conversion's output dtype.
    """

    layout: Callable[[nn.Module], dict]
    dequantize: Callable[[nn.Module], torch.Tensor]
    oracle: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    tolerance: Callable[[nn.Module, torch.dtype], float]
    locate: Callable | None = None
    stored_dtypes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme (``quantization_config.scheme``), as convert, load and verify use it.

    * ``name``: the scheme's name in ``quantization_config``.
    * ``module_class``: the module its quantized layers load as; ``build`` makes one on meta (a
      :data:`ModuleBuilder`), for :func:`quantpack.load` and the transformers quantizer.
    * ``stored(shape, bits, group_size, axis, dtype)``: the tensors a quantized (N, K) layer stores, as
      ``{suffix: (shape, dtype)}`` (``qweight``, ...; a bias is stored as the source's), ``dtype`` the
      conversion's output dtype.
    * ``quantize(weight, bits, group_size, axis, method, dtype, input_weights=None)``: what convert stores for one
      (N, K) weight: ``({suffix: tensor}, the dequantized float32 weight)``, the tensors as :attr:`stored` says;
      ``input_weights`` (K,): per-input-feature weights for ``method="refit"`` (see quantpack.quantization.groupwise.quantize).
    * ``check``: how verify checks its modules (:class:`ModuleCheck`).
    """

    name: str
    module_class: type
    build: ModuleBuilder
    stored: Callable[..., dict[str, tuple[tuple[int, ...], torch.dtype]]]
    quantize: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]
    check: ModuleCheck
