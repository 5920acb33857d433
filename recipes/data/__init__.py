"""The data of the LM and MLM tasks, from the recipe's ``data`` section to the batches a step
takes: ``section`` (the recipe fields), ``corpus`` (text sources read), ``sources`` and
``tokenize`` (`builder tokenize`: any corpus into a tokenized dataset), ``tokenized`` (that
format), ``megatron`` (Megatron-LM and nanoGPT token files), ``mixture`` (sources drawn by
weight) and ``windows`` (windows, document masks, the resumable loader). See README.md."""
