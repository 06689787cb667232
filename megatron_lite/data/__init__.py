"""Tokenizers, indexed datasets, preprocessing, and the train/validation sample streams.

Kept free of imports: preprocessing worker processes import from here and should not pay for
torch.
"""
