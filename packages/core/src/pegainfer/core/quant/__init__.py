"""Quantized weights: a checkpoint's `quantization_config` decides each linear layer's
storage, the loader keeps it, kernels consume it, and the torch reference dequantizes it.

How a model line declares a quantized linear layer:

1. Parse the scheme once: `scheme = parse_quantization(ctx.config)` (`quant.scheme`; None for
   an unquantized checkpoint). Refuse what the line cannot run, e.g. a quantized LM head
   (`scheme.format_for("lm_head")`).
2. Build each linear weight with `linear_weight(out, in, fmt)` (`quant.linear`), where
   `fmt = scheme.common_format([checkpoint module names])` lists the checkpoint layers that
   become this one matrix (`model.layers.3.self_attn.q_proj`, `...k_proj`, `...v_proj` for a
   fused qkv). It is a plain parameter when `fmt` is None, else a `QuantLinear` whose
   parameters are named by the stored tensors' suffixes.
3. Apply it with `linear(x, weight)` (or `parallel.row_parallel_linear`, which does).
4. Leave `checkpoint_name_map` as it is: map `<module>.weight` to the weight's attribute name,
   rows and columns in elements; `loading.weights.load_weights` sends each stored tensor
   (`weight`, `weight_scale_inv`, `weight_packed`, `weight_scale`) to the parameter of that
   suffix with the selection scaled to its blocks, refuses a tensor-parallel split or fused
   offset that cuts a block (fused parts must start on a block row; only the last may end in a
   partial block), and checks INT4's `weight_shape`.

`build_and_load` refuses a quantized checkpoint for a model with no quantized parameter, so a
line that has not done the above fails at load with a clear message rather than serving
garbage.

MoE layers (`core.moe.layer`): pass `MLPFormats(gate_up=fmt, down=fmt)` to `MoE(routed=...,
shared=...)`, `DenseMLP` or `SwiGLU`, each format from `scheme.common_format` over the
checkpoint names (`model.layers.L.mlp.experts.E.gate_proj` ... for all of this rank's experts).
A bank of routed experts is then two `QuantLinear` stacks, filled through the same per-expert
row offsets as plain ones (FP8: each expert's widths must be whole blocks, 128 rows for Kimi;
INT4: any), and `RoutedExperts.weights()` hands the compute a `QuantizedExpertWeights`: the
fused Triton MoE with each weight tile dequantized in the kernel on CUDA, each chosen expert
dequantized exactly, then the reference, elsewhere.
"""
