#!/usr/bin/env python
"""Tokenise a corpus once into sharded memmaps (the same as `sinklab prepare`); see sinklab/data/prepare.py.

    python scripts/prepare_data.py --config conf/data/pile.yaml --out /data/pile_neox --num-proc 16
"""

import sys

from sinklab.cli.prepare import main
from sinklab.errors import UserError

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:], prog="python scripts/prepare_data.py"))
    except UserError as err:
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        sys.exit(2)
