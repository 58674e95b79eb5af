"""What a run keeps on disk: its run directory (owned by one run at a time), checkpoints with
their manifest, and files that are written whole or not at all."""
