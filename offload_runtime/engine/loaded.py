"""`LoadedModel`: what `load_offloaded` returns, the one owner of a loaded model's parts.

It holds the transformers model (`module`), the runtime that serves its experts (`runtime`, an
`OffloadRuntime` or a `ResidentRuntime`, both a `model_runtime.ModelRuntime`), the memory plan
(`plan`) and the options it was loaded with (`options`). Everything else reads through to the
transformers model, so code written for one runs on it unchanged: `generate(...)`, `config`,
`model.layers`, calling it, its modules and parameters are the model's own. It delegates rather
than asking callers for `loaded.module.generate` so that every caller of a transformers model (the
exactness tests, tracing, the server's scheduler, lm-eval) keeps working as it was written; the
wrapped model is `module`, as a wrapper names it in torch (`DistributedDataParallel.module`), since
`model` is already the name of a transformers model's base model.

The transformers model holds no reference back: code that needs the runtime (CGOPipe's decoders,
tracing, `tune`) is handed the `LoadedModel` and reads `runtime` from it. The hooks the runtime
puts on the model are its own bound methods, so the model's forward needs no way back either.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from offload_runtime.engine.memory_plan import MemoryPlan
from offload_runtime.engine.model_runtime import ModelRuntime
from offload_runtime.engine.options import RuntimeOptions


class LoadedModel:
    """A model loaded by `load_offloaded`: `module` (the transformers model), `runtime` (its
    `ModelRuntime`: `stats()`, `close()`), `plan` (its `MemoryPlan`, None under a budget) and
    `options` (its `RuntimeOptions`). Any other attribute, and calling it, is the transformers
    model's (`loaded.generate(...)`). `with loaded:` closes the runtime on leaving (it stops its
    threads); a model dropped unclosed stops them once garbage-collected."""

    def __init__(self, module: nn.Module, runtime: ModelRuntime) -> None:
        self.__dict__.update(module=module, runtime=runtime)

    @property
    def plan(self) -> MemoryPlan | None:
        """What the memory cap bought (resident, mapped or so many slots); None under a budget."""
        return self.runtime.memory_plan

    @property
    def options(self) -> RuntimeOptions:
        """The options the model was loaded with, as resolved."""
        return self.runtime.options

    def __getattr__(self, name: str) -> Any:
        if "module" not in self.__dict__:  # not yet made (a copy, an unpickling)
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.module, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def close(self) -> None:
        """Stop the runtime (its threads, hooks); safe to call twice."""
        self.runtime.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoadedModel({type(self.module).__name__}, plan={self.plan.line() if self.plan else None!r})"
