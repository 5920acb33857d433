"""Suite-wide settings."""

import torch

# Tiny models on a 2-core CI machine: one intra-op thread avoids oversubscription, which made
# small decoding loops up to ~100x slower when the cores were busy.
torch.set_num_threads(1)
