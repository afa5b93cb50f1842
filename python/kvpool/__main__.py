"""`python -m kvpool` runs the CLI."""

from kvpool.sim.cli import main

raise SystemExit(main())
