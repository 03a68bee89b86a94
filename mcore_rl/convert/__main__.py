"""`python -m mcore_rl.convert {hf-to-mcore,mcore-to-hf} ...`"""

import sys

from mcore_rl.convert.cli import main

try:
    code = main()
finally:
    # gloo's worker threads are joined here, not in the interpreter's teardown, where a group still
    # alive ended the process with "terminate called without an active exception" (SIGABRT, CI)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from mcore_rl.parallel.groups import destroy

        destroy()
raise SystemExit(code)
