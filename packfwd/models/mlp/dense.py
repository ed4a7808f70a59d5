"""The dense gated MLP (SwiGLU) as a layer component: every layer of a dense family, and the ``Moe.dense_layers`` of
a Mixture-of-Experts one.  It owns ``ModelArgs.ffn_hidden_size``; ``ModelArgs.linear_bias`` (a bias on every linear,
Llama's ``attention_bias`` with ``mlp_bias``) is the model's, read here for the MLP's biases.

Layer spec: Megatron-Core's ``MLP`` with tensor-parallel linears; its activation module is
:class:`packfwd.ops.swiglu.SwiGLU` (named always, built by Megatron-Core only under
``config.use_te_activation_func``, which ``transformer_config`` sets from ``ModelArgs.fused``)::

    linear_fc1.weight  [2 * ffn, hidden]   [gate; up]: HF gate_proj, up_proj (TP rank r: [gate_r; up_r])
    linear_fc2.weight  [hidden, ffn]       HF down_proj (TP: columns)
"""

from __future__ import annotations

from ..component import Component
from ..mapping import Weight

__all__ = ["DENSE", "DenseMlp"]


def _linear_bias(args) -> bool:
    return args.linear_bias


# One dense layer's MLP weights: Megatron-Core (under decoder.layers.{j}.) <- HF (under model.layers.{i}.).
WEIGHTS = (
    Weight("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    Weight("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "gate_up", when=_linear_bias),
    Weight("mlp.linear_fc2.weight", "mlp.down_proj.weight", "cols"),
    Weight("mlp.linear_fc2.bias", "mlp.down_proj.bias", when=_linear_bias),
)


class DenseMlp(Component):
    """The dense SwiGLU MLP component (module docstring).

    >>> DENSE.layer_spec(None, 0).submodules.activation_func.__name__, [w.split for w in WEIGHTS[::2]]
    ('SwiGLU', ['gate_up', 'cols'])
    """

    name = "dense SwiGLU MLP"
    fields = ("ffn_hidden_size",)

    def config_fields(self, args) -> dict:
        return dict(ffn_hidden_size=args.ffn_hidden_size)

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        return (("ffn_hidden_size", args.ffn_hidden_size),)

    def weights(self, args) -> tuple[Weight, ...]:
        return WEIGHTS

    def layer_spec(self, args, layer: int, **params):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLP, MLPSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec

        from packfwd.ops.swiglu import SwiGLU

        return ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=SwiGLU))


DENSE = DenseMlp()
