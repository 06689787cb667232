"""Checkpointing. Saving and resuming currently go through DeepSpeed's own format
(``Trainer.save`` / ``Trainer.maybe_resume``); the sharded, atomic format lands here."""
