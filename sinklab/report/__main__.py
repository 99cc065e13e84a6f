"""`python -m sinklab.report SWEEP_DIR [--out DIR]`: the same as `sinklab report`."""
import sys

from sinklab.report.cli import main

sys.exit(main())
