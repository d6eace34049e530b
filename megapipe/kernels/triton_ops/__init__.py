"""Triton kernels of the fused ops, one module per op, each with the autograd Function that
launches them. Importing any of these imports Triton (seconds), so only an op's `*_triton`
entry point in megapipe/kernels/<op>.py imports them, on its first call."""
