"""`python -m fleet.sim serve MODEL ...` and `python -m fleet.sim smi`."""
import sys

from fleet.sim.cli import main

# The guard matters: the spawned engine child must not run the CLI again.
if __name__ == "__main__":
    sys.exit(main())
