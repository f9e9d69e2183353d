"""``python -m openinfer ...`` is the ``openinfer`` command."""

import sys

from openinfer.cli import main

sys.exit(main())
