# Runs at the start of every Python process that has this directory on PYTHONPATH (SGLang's
# engine processes on CPU): mcore_rl's CPU stand-ins go in place when SGLang, or a module they
# stand in for, is first imported. Not before: installing them imports torch (seconds of CPU), and
# some of these processes never import SGLang (multiprocessing's resource tracker).
import os
import sys

if os.environ.get("MCORE_RL_SGLANG_CPU") == "1":

    class _InstallOnFirstImport:
        NAMES = ("sglang", "sgl_kernel", "torchvision")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in self.NAMES:
                return None
            sys.meta_path.remove(self)
            from mcore_rl.rollout import sglang_cpu

            sglang_cpu.install()
            # the installed finder sits before this one's place in the list being searched: ask it here
            return sglang_cpu._StandInFinder().find_spec(name, path, target)

    sys.meta_path.insert(0, _InstallOnFirstImport())
