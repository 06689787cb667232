"""Launcher adapters that run the trainer under a scheduler of their own (Ray Train)."""
