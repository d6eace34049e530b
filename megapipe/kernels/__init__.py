"""Fused ops, one module per op, each with its plain-torch reference (the specification, and
what runs on CPU) beside its fused implementations:

- bias_gelu: gelu(x + bias), exact erf or tanh (--openai-gelu);
- bias_dropout_add: residual + dropout(x + bias) with a given keep-mask;
- swiglu: silu(gate) * up of fc1's [gate; up];
- rotary: rotate-half rotary embedding with a position offset;
- layer_norm, rms_norm (apex and TE rows too), masked_softmax, cross_entropy.

availability.py probes Triton, apex, TransformerEngine and flash_attn at run time (importing
megapipe never needs them); dispatch.py chooses each op's implementation from the flags, the
device and what is installed. Triton kernels live in triton_ops/, imported on first use;
norm_backends.py holds the norms' apex and TE rows; transformer_engine.py decides whether TE
and FP8 may run and builds FP8's recipe and autocast (the TE layers: model/te_layers.py).
Each op's inputs for the benchmark and the CUDA tests: megapipe/testing/kernel_cases.py.
"""
