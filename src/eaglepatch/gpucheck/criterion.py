"""The GPU check's comparison: relative error per token row.

For a captured state ``x`` [T, H] and its reference ``ref`` [T, H] (float32), the error of row t
is ``|x_t - ref_t| / |ref_t|`` (L2 norms). A state passes when every row's error is at most
``TOL``. On the check model (models.CHECK_MODEL) bf16 rounding stays near 1% per layer while a
neighbouring layer, a skipped final norm or a tensor-parallel partial sum is off by 50% or more in
every row; tests/test_gpucheck_model.py measures both sides on CPU and docs/gpu.md lists them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TOL = 0.1


def row_errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row (float32 [T]); a NaN or Inf row is an infinite error."""
    x = x.detach().float().cpu()
    ref = ref.detach().float().cpu()
    if x.shape != ref.shape:
        raise ValueError("shape %s != reference shape %s" % (tuple(x.shape), tuple(ref.shape)))
    if x.dim() != 2:
        raise ValueError("want [tokens, hidden], got %s" % (tuple(x.shape),))
    err = (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-20)
    err[~torch.isfinite(x).all(dim=-1)] = float("inf")
    return err


@dataclass
class Comparison:
    name: str
    rows: int
    max_err: float
    worst_row: int
    passed: bool
    tol: float = TOL

    def line(self) -> str:
        return "%s: %d rows, max row error %.4g (row %d) %s %g" % (
            self.name, self.rows, self.max_err, self.worst_row, "<=" if self.passed else ">", self.tol)

    def as_dict(self) -> dict:
        return asdict(self)


def compare(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> Comparison:
    err = row_errors(x, ref)
    if err.numel() == 0:
        return Comparison(name, 0, 0.0, -1, True, tol)
    worst = int(torch.argmax(torch.nan_to_num(err, nan=float("inf"))))
    m = float(err[worst])
    return Comparison(name, int(err.numel()), m, worst, bool(m <= tol), tol)


def min_row_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The smallest row error: how far every row of a wrong state is from the reference."""
    err = row_errors(x, ref)
    return float(err.min()) if err.numel() else float("inf")


def merge(name: str, parts: list[Comparison]) -> Comparison:
    """One verdict over several comparisons (worst row wins)."""
    if not parts:
        return Comparison(name, 0, 0.0, -1, False)
    worst = max(parts, key=lambda c: c.max_err)
    return Comparison(name, sum(c.rows for c in parts), worst.max_err, worst.worst_row,
                      all(c.passed for c in parts), worst.tol)


__all__ = ["TOL", "row_errors", "compare", "min_row_error", "merge", "Comparison"]
