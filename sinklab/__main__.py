"""`python -m sinklab COMMAND ...` is `sinklab COMMAND ...` (`sinklab.cli`): the one module entry point; training is
`sinklab-train` (`python -m sinklab.train.entry`)."""
import sys

from sinklab.cli import main

sys.exit(main())
