"""`python -m sinklab.cli ...` = `sinklab ...`."""
import sys

from sinklab.cli import main

sys.exit(main())
