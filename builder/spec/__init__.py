"""The spec pipeline, torch-free: located YAML (``source``), one merge, ``extends:`` chains and
overrides (``loader``), the schema every field is checked against (``schema``, ``problems``), its
JSON Schema, the kinds of YAML document a file can be (``kinds``) and user block plugins."""
