"""`python -m converters {hf-to-mcore,mcore-to-hf} ...`"""

from converters.cli import main

raise SystemExit(main())
