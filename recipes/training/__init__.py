"""One training run: the run loop, its LightningModule, callbacks, run folder and logs, signals,
precision and speed settings, the dry run."""
