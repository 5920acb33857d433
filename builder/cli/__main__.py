"""`python -m builder.cli`: the same as the `builder` command."""

import sys

from builder.cli import main

sys.exit(main())
