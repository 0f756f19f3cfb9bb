"""`python -m kiln ...` (and `torchrun ... -m kiln train ...`): the `kiln` command."""
from kiln.cli.main import entry

entry()
