"""Registered PyTorch blocks. ``blocks.configs`` holds their torch-free configs and counts."""
