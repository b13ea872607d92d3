"""mci — mission-critical inference for DeepSeek-V3-class models.

The public face, for use in a Python process (`from mci import Engine`):

    Engine          the in-process engine (mci/engine/engine.py): generate, add_request,
                    stream, abort, shutdown
    EngineConfig    its frozen configuration (mci/engine/config.py)
    SamplingParams  what a request asks for (mci/core/sampling_params.py)

They load on first use, so that `import mci` (and `mci --help`) stays light: the engine pulls
in torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]

_PUBLIC = {
    "Engine": "mci.engine.engine",
    "EngineConfig": "mci.engine.config",
    "SamplingParams": "mci.core.sampling_params",
}

if TYPE_CHECKING:
    from mci.core.sampling_params import SamplingParams
    from mci.engine.config import EngineConfig
    from mci.engine.engine import Engine


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'mci' has no attribute {name!r}")
