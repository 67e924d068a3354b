"""``python -m paged_runtime serve [MODEL]``: the same as the ``paged-runtime`` command."""
import sys

from paged_runtime.entrypoints.cli import main

sys.exit(main())
