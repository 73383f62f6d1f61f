"""``python -m tpassrun``: same as the ``tpassrun`` console script."""

import sys

from tpassrun.cli import main

sys.exit(main())
