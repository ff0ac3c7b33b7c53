"""``python -m torchcontract.demo``: see ``torchcontract.demo``."""

from torchcontract.demo import main

main()
