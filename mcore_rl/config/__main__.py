"""`python -m mcore_rl.config CONFIG.yaml [key=value ...]` (the resolved config) and
`python -m mcore_rl.config --schema` (docs/config.md): the typed config's command line."""

from mcore_rl.config.sections import main

raise SystemExit(main())
