"""Scoring functions of the MoE gates (``tile_kernels.moe.scoring``); pure Python, no Triton import."""

from __future__ import annotations

import enum

__all__ = ["ScoringFunc"]


class ScoringFunc(enum.IntEnum):
    """How a gate turns logits into expert scores.

    ``SIGMOID`` = 1/(1+e^-x); ``SQRTSOFTPLUS`` = sqrt(softplus(x)) with softplus(x) = x for x > 20,
    else log1p(e^x); ``SOFTMAX`` over the experts of a token; ``IDENTITY`` (not supported by
    ``top2_sum_gate``).  ``str(f)`` is the lower-case name, ``ScoringFunc.from_str`` its inverse.
    """

    SIGMOID = 0
    SQRTSOFTPLUS = 1
    SOFTMAX = 2
    IDENTITY = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def from_str(cls, label: str) -> "ScoringFunc":
        """The member named ``label`` (case-insensitive); ``ValueError`` for anything else."""
        if isinstance(label, cls):
            return label
        if isinstance(label, str):
            member = cls.__members__.get(label.upper())
            if member is not None:
                return member
        raise ValueError(f"{label} is not a valid ScoringFunc")
