"""``python -m packfwd``: the command line of :mod:`packfwd.viz.cli`; also the ``packfwd`` console script's target."""
from packfwd.viz.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
