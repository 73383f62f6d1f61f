"""``python -m tpassrun``: same as the ``tpassrun`` console script."""

import sys

from .cli import main

sys.exit(main())
