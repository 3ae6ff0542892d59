"""Errors raised while loading or resolving a policy document; each names the field and YAML position.

PolicyError                 .field (dotted path), .line / .column (1-based, None if unknown)
├── PluginNotFoundError     the named module, attribute or entry point does not exist
└── PluginImportError       the plugin's module exists but raised while importing
"""

from __future__ import annotations

__all__ = ["PluginImportError", "PluginNotFoundError", "PolicyError"]


class PolicyError(ValueError):
    """A policy document was rejected; the running policy stays in force.

    ``str(err)`` reads ``line 4, column 3: process_groups.policy: ...`` so an operator can jump to it.
    """

    def __init__(
        self,
        message: str,
        line: int | None = None,
        column: int | None = None,
        *,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.line = line
        self.column = column
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = ""
        if self.line is not None:
            where = (
                f"line {self.line}" + (f", column {self.column}" if self.column is not None else "") + ": "
            )
        what = f"{self.field}: " if self.field else ""
        return f"{where}{what}{self.message}"

    def at(self, line: int | None, column: int | None, field: str | None = None) -> PolicyError:
        """Return a copy of this error placed at a YAML position (keeps the subclass)."""
        located = type(self).__new__(type(self))
        PolicyError.__init__(located, self.message, line, column, field=field or self.field)
        located.__cause__ = self.__cause__
        return located

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for an HTTP 400 body."""
        return {"message": self.message, "field": self.field, "line": self.line, "column": self.column}


class PluginNotFoundError(PolicyError):
    """``module:Class`` or an entry point name that does not resolve to anything."""


class PluginImportError(PolicyError):
    """The plugin's module was found but its own import raised; ``__cause__`` holds that exception."""
