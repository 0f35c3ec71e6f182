"""`python -m tk_mlir ...`: the tk-mlir command line (tk_mlir/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tk_mlir"))
