"""The recipe file, torch-free: its sections and fields (``sections``, ``task_sections``,
``fields``), loading it with its locations, its JSON Schema and its kind of YAML document."""
