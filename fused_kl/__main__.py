"""``python -m fused_kl``: the ``fused-kl`` command line."""

import sys

from fused_kl.cli import main

if __name__ == "__main__":
    sys.exit(main())
