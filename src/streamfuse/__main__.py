"""`python -m streamfuse`: the same command line as the `streamfuse` console script."""

from streamfuse.cli import main

raise SystemExit(main())
