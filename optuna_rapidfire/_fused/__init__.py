"""The multi-adapter kernels the engines and trainer kinds use.

Fused passes over the model's modules, the launched decoder, the gang's slots and AdamW, counter-based
dropout, token statistics without float32 logits, and the shared decode.
"""
