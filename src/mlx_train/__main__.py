"""``python -m mlx_train`` runs the ``mlx-train`` command."""

import sys

from mlx_train.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
