"""Traces moves between tpassrun's modules in every Python process of a job, when ``TPASSRUN_HOPS_TRACE`` names a directory.

Put this directory first on ``PYTHONPATH`` (bench/hops_swap.py does): every Python process started with that
environment (the agents, their workers, the spares) imports it at start-up. With the variable unset it does nothing
else than that one lookup; set, it installs :class:`hopcount.Recorder` on every thread and writes
``<dir>/<pid>.json`` when the process ends (interpreter exit or ``os._exit``). A forked child starts a fresh record.
This is the one place that reads the variable (its name is declared in tpassrun/settings/envnames.py).
"""

import os

_OUT = os.environ.get("TPASSRUN_HOPS_TRACE")

if _OUT:
    import atexit
    import importlib.util
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hopcount

    def _start() -> None:
        spec = importlib.util.find_spec("tpassrun")          # found, not imported
        if spec is None or not spec.origin:
            return
        tree = os.path.dirname(os.path.dirname(spec.origin))
        recorder = hopcount.Recorder(tree)
        written = []
        env = {k: v for k, v in os.environ.items() if k.startswith("TPASSRUN_") or k in ("RANK", "LOCAL_RANK")}

        def write() -> None:
            if written:
                return
            written.append(True)
            sys.setprofile(None)
            meta = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.argv), "tree": tree, "env": env}
            recorder.dump(os.path.join(_OUT, f"{os.getpid()}.json"), meta)

        real_exit = os._exit

        def _exit(code: int) -> None:
            try:
                write()
            finally:
                real_exit(code)

        def forked() -> None:
            recorder.moves.clear()
            written.clear()

        os._exit = _exit
        atexit.register(write)
        os.register_at_fork(after_in_child=forked)
        recorder.install()

    _start()
