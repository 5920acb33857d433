"""Registered PyTorch blocks. ``blocks.configs`` holds their torch-free configs and counts."""

__project__ = "transformer-builder"  # checked by builder.packages: this name is ours
