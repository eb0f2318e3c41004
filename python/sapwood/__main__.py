"""`python -m sapwood ...` is the `sapwood` command."""
from .cli import main

raise SystemExit(main())
