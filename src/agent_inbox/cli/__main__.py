"""`python -m agent_inbox.cli`: the same as the `agent-inbox` console script."""

import sys

from agent_inbox.cli.main import main

sys.exit(main())
