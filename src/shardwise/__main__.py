"""``python -m shardwise``: the command line (see ``shardwise.cli``)."""

from .cli import main

raise SystemExit(main())
