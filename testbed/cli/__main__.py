"""`python -m testbed.cli`: the `dualpath` command."""
from testbed.cli import main

main()
