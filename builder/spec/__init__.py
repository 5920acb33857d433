"""The spec pipeline, torch-free: located YAML (``source``), one merge, ``extends:`` chains and
overrides (``loader``), the schema every field is checked against (``schema``, ``problems``), its
JSON Schema, the spec as a kind of YAML document (``kind``; the kinds themselves are
``yamlformer.builder.kinds``, below the zoo that lists their files) and user block plugins."""
