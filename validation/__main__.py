"""``python -m validation``: the validation runner (``scripts/validate``; see validation.cli)."""

import sys

from validation.cli import main

if __name__ == "__main__":
    sys.exit(main())
