"""The optimizer (AdamW, decay on matrices only) and the learning-rate schedule."""
