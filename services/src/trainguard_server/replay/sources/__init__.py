"""Readers of what users already have (one small module per format, behind :class:`.base.Source`), and the
registry that detects them (:mod:`.registry`). Optional libraries (tensorboard, wandb) are imported only
when a reader of theirs reads."""
