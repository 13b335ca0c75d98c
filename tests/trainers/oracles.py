"""The oracles of the trainer drop-ins: the real verl and OpenRLHF modules, imported in their side venv.

OpenRLHF's package `openrlhf.models` imports its Actor on import, which needs flash-attn (no CPU build) and peft.
The loss and log-prob functions live in `openrlhf.models.loss` / `openrlhf.models.utils`, which need neither, so
`openrlhf_models()` registers the package without running its __init__ and imports those two real modules.
"""

import importlib
import importlib.util
import sys
import types


def openrlhf_models():
    """(openrlhf.models.loss, openrlhf.models.utils), OpenRLHF's own modules, without openrlhf/models/__init__."""
    if "openrlhf.models" not in sys.modules:
        import openrlhf

        pkg = types.ModuleType("openrlhf.models")
        pkg.__path__ = [p + "/models" for p in openrlhf.__path__]
        sys.modules["openrlhf.models"] = pkg
    return importlib.import_module("openrlhf.models.loss"), importlib.import_module("openrlhf.models.utils")
