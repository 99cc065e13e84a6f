"""`python -m sinklab.report SWEEP_DIR [--out DIR]`: the same as `sinklab report` (`sinklab.cli.report`)."""
import sys

from sinklab.cli.report import main

sys.exit(main())
