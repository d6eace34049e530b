"""Text generation: sampling and the generation loop over TP and PP (the KV cache the model
layers fill is model/kv_cache.py)."""
