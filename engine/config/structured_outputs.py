"""StructuredOutputsConfig: the engine-wide structured-output settings.

vLLM twin: ``vllm/config/structured_outputs.py``. Sessions: 06.

Simpler than vLLM: one backend, xgrammar (``"auto"`` picks it); vLLM's other
backend names are refused with a message saying so; no reasoning parsers.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's backends that Glassbox does not have.
_VLLM_ONLY_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"
    """Grammar backend: auto or xgrammar (auto picks xgrammar)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace between tokens (compact output)."""
    disable_additional_properties: bool = False
    """A guidance-backend option in vLLM; refused here."""

    def __post_init__(self) -> None:
        if self.backend in _VLLM_ONLY_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend={self.backend!r} is a vLLM backend "
                "Glassbox does not have; use 'auto' or 'xgrammar'"
            )
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(
                f"structured_outputs_config.backend={self.backend!r} is unknown; "
                "use 'auto' or 'xgrammar'"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs_config.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )
        if self.disable_additional_properties:
            raise ValueError(
                "structured_outputs_config.disable_additional_properties is only for the "
                "guidance backend (as in vLLM)"
            )

    @classmethod
    def from_dict(cls, values: dict) -> StructuredOutputsConfig:
        """Glassbox's own: the CLI's JSON object, with unknown keys named."""
        if not isinstance(values, dict):
            raise ValueError(
                "structured_outputs_config must be a JSON object (a dict), got "
                f"{type(values).__name__}"
            )
        unknown = sorted(
            set(values) - {"backend", "disable_any_whitespace", "disable_additional_properties"}
        )
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown field(s) {unknown}")
        return cls(**values)
