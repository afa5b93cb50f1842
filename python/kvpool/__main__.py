"""`python -m kvpool` runs the CLI."""

from kvpool.cli import main

raise SystemExit(main())
