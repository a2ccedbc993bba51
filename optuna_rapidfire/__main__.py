"""``python -m optuna_rapidfire`` is the ``optuna-rapidfire`` command."""

import sys

from optuna_rapidfire.cli import main

sys.exit(main())
