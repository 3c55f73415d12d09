"""``python -m verl_ops``: run the demo (see :mod:`verl_ops.demo`)."""

import sys

from .demo import main

sys.exit(main())
