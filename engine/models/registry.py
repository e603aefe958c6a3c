"""Architecture name (config.json `architectures[0]`) -> model class.

Model files register themselves with `@register_model("...ForCausalLM")`; the loader asks the
registry, so adding an architecture never touches an if/elif chain.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

_REGISTRY: dict[str, type] = {}
_MODEL_MODULES = ("engine.models.deepseek_v2", "engine.models.deepseek_v32", "engine.models.deepseek_v4")


def register_model(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return wrap


def get_model_class(architecture: str) -> type:
    for module in _MODEL_MODULES:
        importlib.import_module(module)
    if architecture not in _REGISTRY:
        raise ValueError(
            f"config.json architecture {architecture!r} is not supported (supported: {', '.join(sorted(_REGISTRY))})"
        )
    return _REGISTRY[architecture]
