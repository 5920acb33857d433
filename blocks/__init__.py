"""Registered PyTorch blocks. ``yamlformer.blocks.configs`` holds their torch-free configs and counts."""

__project__ = "yamlformer"  # checked by yamlformer.builder.packages: this name is ours
