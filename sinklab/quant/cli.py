"""`python -m sinklab.quant.cli ...` is `sinklab quant ...`; the command is `sinklab.cli.quant`."""
import sys

if __name__ == "__main__":
    from sinklab.cli.quant import main

    sys.exit(main())
