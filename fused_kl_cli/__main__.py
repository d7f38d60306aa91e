"""``python -m fused_kl_cli``: the ``fused-kl`` command line."""

import sys

from fused_kl_cli.cli import main

if __name__ == "__main__":
    sys.exit(main())
