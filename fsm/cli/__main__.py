"""`python -m fsm.cli ...` is `agentfsm ...`."""

import sys

from fsm.cli.commands import main

sys.exit(main())
