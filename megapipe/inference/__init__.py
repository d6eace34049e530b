"""Text generation: a KV cache, sampling, and the generation loop over TP and PP."""
