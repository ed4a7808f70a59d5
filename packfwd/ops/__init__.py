"""Kernels beside their launchers, one file per kernel family: ``gather`` (the row gather every layout applies),
``plan`` (a layout's per-token maps planned on CUDA in one kernel), ``logprob`` (fused log-probs and entropy),
``linear_logprob`` (the same per vocab block of ``hidden @ weight.T``), ``rmsnorm`` (RMSNorm, optionally with the
residual add), ``swiglu`` (Megatron-Core's gated SiLU, and the same times the MoE routing probability), ``rope``
(THD RoPE of query and key, Megatron's bits), ``slot_sum`` (the MoE combine's ordered sum) and ``zero_groups``
(the empty experts' weight gradients); what each costs on an H200 is in benchmarks/RESULTS.md.

Each file works without Triton (CPU installs): the torch path is the reference, the kernels are used on CUDA
(and tested on the CPU too, in Triton's interpreter: ``tests/gpu/test_*_kernel.py``).

Nothing is re-exported: the layouts and ``packfwd.logits`` call these modules; users call those.
"""

__all__: list[str] = []
