"""`python -m kiln ...` (and `torchrun ... -m kiln train ...`): the `kiln` command."""
import sys

from kiln.cli.main import main

sys.exit(main())
