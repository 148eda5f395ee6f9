"""``python -m kwplug`` runs the ``kwplug`` command line."""

import sys

from kwplug.cli import main

sys.exit(main())
