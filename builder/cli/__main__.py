"""`python -m yamlformer.builder.cli`: the same as the `builder` command."""

import sys

from yamlformer.builder.cli import main

sys.exit(main())
