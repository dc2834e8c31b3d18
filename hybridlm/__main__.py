"""`python -m hybridlm ...` is the same as the `hybridlm` command."""

from .cli import main

raise SystemExit(main())
