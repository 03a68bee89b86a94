"""`python -m converters {hf-to-mcore,mcore-to-hf} ...`"""

from converters.cli import main
from mcore_rl.parallel import destroy

try:
    code = main()
finally:
    # gloo's worker threads are joined here, not in the interpreter's teardown, where a group still
    # alive ended the process with "terminate called without an active exception" (SIGABRT, CI)
    destroy()
raise SystemExit(code)
