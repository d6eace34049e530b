"""Test support: what megapipe's tests, tools and benchmarks use, and the runtime never imports.

- harness.py: `run_distributed(fn, world_size, *args)` runs fn on N forked gloo CPU ranks;
  `train_with_flags` trains one rank from pretrain_gpt.py's flags (re-exported here);
- parity.py: how far a parallel model's shards are from the single-rank reference;
- reference_gpt.py: a plain-PyTorch GPT of megapipe's math, the golden reference;
- kernel_cases.py: the inputs each fused op is benchmarked and tested on.
"""

from megapipe.testing.harness import DistributedTestError, run_distributed, train_with_flags

__all__ = ["DistributedTestError", "run_distributed", "train_with_flags"]
