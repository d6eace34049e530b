"""Conversion between checkpoint layouts and formats, and to and from Hugging Face.

It sits above `model`, `pipeline` and `checkpointing`: converting builds the model at the target
layout (`model.gpt`, `pipeline.partition`) and reads and writes through `checkpointing`'s
formats, which themselves know nothing of the model. Used by `tools/checkpoint/convert.py`,
`tools/generate_text.py` (via `inference`) and the tests.
"""
