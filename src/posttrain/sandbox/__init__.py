"""Running untrusted (model-written) Python programs: a fresh directory, a clean environment,
resource and wall-clock limits, and isolation at the strongest level that works here
(bubblewrap, Linux namespaces, or resource limits alone); no process of a run outlives the
call. ``run.py`` runs a program, ``isolation.py`` builds each level, ``inside.py`` sets up the
namespaces level from inside, ``pipes.py`` moves a run's stdin and output, ``procs.py`` finds
and kills a run's processes, ``uids.py`` hands out the uids runs get when the trainer is
root.

Linux only. It does not judge what a program printed (``posttrain.rewards.code`` does).
"""

from posttrain.sandbox.isolation import SandboxError
from posttrain.sandbox.run import Limits, Result, Sandbox, available_levels

__all__ = ["Limits", "Result", "Sandbox", "SandboxError", "available_levels"]
