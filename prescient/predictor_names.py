"""The built-in predictors' names as users write them: what `predictor.registry` resolves, and what
the command line's help lists without importing the predictors (and torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Builtin:
    name: str  # what users type
    kind: str  # the registered class's kind (also accepted as a name)
    needs: str  # "train trace", "evaluated trace" or "model"
    aliases: tuple[str, ...] = ()


BUILTINS = (
    Builtin("freq", "frequency", "train trace"),
    Builtin("token", "token-table", "train trace"),
    Builtin("corr", "klotski-correlation", "train trace", ("correlation", "klotski")),
    Builtin("oracle", "oracle", "evaluated trace"),
    Builtin("lookahead", "gate-lookahead", "model"),
)
NAMES_HELP = (", ".join(b.name for b in BUILTINS) + " (also "
              + ", ".join(alias for b in BUILTINS for alias in (b.kind, *b.aliases) if alias != b.name) + ")")
