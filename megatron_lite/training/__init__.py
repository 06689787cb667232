"""DeepSpeed engine, LR schedule, optimizer, and the training loop."""
