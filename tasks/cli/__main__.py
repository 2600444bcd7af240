"""``python -m tasks.cli``: the ``vip`` command."""

import sys

from tasks.cli import main

sys.exit(main())
