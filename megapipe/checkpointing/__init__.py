"""Checkpoints: layout-free sharded checkpoints (`torch_dist`, on torch.distributed.checkpoint)
that load at any TP/PP/DP layout, with safe writes and loads."""
