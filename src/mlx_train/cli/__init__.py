"""The ``mlx-train`` command line; see :mod:`mlx_train.cli.main`."""
