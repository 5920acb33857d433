"""Scaling laws: Chinchilla's parametric loss ``L(N, D) = E + A / N^alpha + B / D^beta`` fitted to a
study's runs, as Hoffmann et al. (2022) fit it in their approach 3 — the Huber loss (delta 1e-3)
between the predicted and the measured log loss, minimised with L-BFGS from a grid of starts,
in the log-parameters ``a = log A, b = log B, e = log E`` — with the care Besiroglu et al.
(2024, "Chinchilla Scaling: A replication attempt") showed it needs: the Huber loss summed, not
averaged, tight tolerances, the optimum taken over every start, and bootstrap intervals over the
runs rather than a point estimate alone. Torch-free (numpy and scipy).

From a fitted law: the compute-optimal parameters and tokens for a budget ``C`` (with
Chinchilla's ``C = 6 N D``: ``N_opt = G (C/6)^(beta/(alpha+beta))``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``),
and, for a family of specs whose exact training FLOPs per token are known, the member the law
predicts lowest at ``C`` (its tokens ``C / FLOPs per token``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

#: Hoffmann et al.'s Huber delta and grid of starting points
DELTA = 1e-3
GRID = {
    "a": np.arange(0.0, 30.0, 5.0),
    "b": np.arange(0.0, 30.0, 5.0),
    "e": np.arange(-1.0, 2.0, 0.5),
    "alpha": np.arange(0.0, 2.5, 0.5),
    "beta": np.arange(0.0, 2.5, 0.5),
}
#: L-BFGS is run from this many of the grid's best starts (the grid itself is evaluated whole)
STARTS = 32
#: bounds of (a, b, e, alpha, beta): wide of any published fit, and no exp() overflow when a
#: handful of runs leaves a term unidentified (a resample with one token count, say)
BOUNDS = ((-30.0, 80.0), (-30.0, 80.0), (-10.0, 5.0), (0.0, 4.0), (0.0, 4.0))
NAMES = ("E", "A", "B", "alpha", "beta")


@dataclasses.dataclass(frozen=True)
class Law:
    """``L(N, D) = E + A / N^alpha + B / D^beta``."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, params, tokens):
        return self.E + self.A / np.power(params, self.alpha) + self.B / np.power(tokens, self.beta)

    def optimal(self, compute: float) -> tuple[float, float]:
        """``(N, D)`` minimising the loss at ``compute = 6 N D`` FLOPs."""
        total = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / total)
        params = g * (compute / 6) ** (self.beta / total)
        return params, compute / 6 / params

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Fit:
    """A fitted law, the laws of its bootstrap resamples and what it was fitted to."""

    law: Law
    boot: list[Law]
    points: int
    objective: float

    def interval(self, of, level: float = 0.95) -> tuple[float, float]:
        """The bootstrap percentile interval of ``of(law)`` (a number per law)."""
        values = np.array([of(law) for law in self.boot], dtype=float)
        values = values[np.isfinite(values)]
        if not len(values):
            return (math.nan, math.nan)
        tail = (1 - level) / 2 * 100
        return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))

    def intervals(self, level: float = 0.95) -> dict[str, tuple[float, float]]:
        return {name: self.interval(lambda law, n=name: getattr(law, n), level) for name in NAMES}


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, target: np.ndarray, delta: float):
    """The summed Huber loss of the predicted log loss and its gradient in ``(a, b, e, alpha, beta)``."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * x, b - beta * y, np.full_like(x, e)])  # (3, points)
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - target  # log L_hat - log L
    weights /= total  # d log L_hat / d term
    small = np.abs(residual) <= delta
    value = np.where(small, 0.5 * residual**2, delta * (np.abs(residual) - 0.5 * delta)).sum()
    slope = np.where(small, residual, delta * np.sign(residual))
    grad = np.array(
        [
            (slope * weights[0]).sum(),
            (slope * weights[1]).sum(),
            (slope * weights[2]).sum(),
            -(slope * weights[0] * x).sum(),
            -(slope * weights[1] * y).sum(),
        ]
    )
    return value, grad


def _grid_values(x: np.ndarray, y: np.ndarray, target: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Every grid start and its objective, evaluated at once."""
    mesh = np.meshgrid(*(GRID[k] for k in ("a", "b", "e", "alpha", "beta")), indexing="ij")
    starts = np.stack([m.ravel() for m in mesh], axis=1)  # (starts, 5)
    a, b, e, alpha, beta = (starts[:, i : i + 1] for i in range(5))
    terms = np.stack([a - alpha * x, b - beta * y, np.broadcast_to(e, (len(starts), len(x)))])
    top = terms.max(axis=0)
    residual = top + np.log(np.exp(terms - top).sum(axis=0)) - target
    huber = np.where(np.abs(residual) <= delta, 0.5 * residual**2, delta * (np.abs(residual) - 0.5 * delta))
    return starts, huber.sum(axis=1)


def _minimise(theta0: np.ndarray, x, y, target, delta: float):

    return minimize(
        _objective,
        theta0,
        args=(x, y, target, delta),
        jac=True,
        method="L-BFGS-B",
        bounds=BOUNDS,
        options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-12},
    )


def fit_law(params, tokens, losses, delta: float = DELTA, starts: int = STARTS, extra=()) -> tuple[Law, float]:
    """``(law, objective)``: the best of L-BFGS runs from the ``starts`` best grid points (and
    ``extra`` starting points, as ``(a, b, e, alpha, beta)``)."""
    x, y = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    target = np.log(np.asarray(losses, float))
    grid, values = _grid_values(x, y, target, delta)
    chosen = [grid[i] for i in np.argsort(values)[:starts]] + [np.asarray(t, float) for t in extra]
    best = None
    for theta0 in chosen:
        result = _minimise(theta0, x, y, target, delta)
        if best is None or result.fun < best.fun:
            best = result
    a, b, e, alpha, beta = best.x
    return Law(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta)), float(best.fun)


def fit(params, tokens, losses, bootstrap: int = 200, seed: int = 0, delta: float = DELTA) -> Fit:
    """The law fitted to every point, and to ``bootstrap`` resamples of the points (with
    replacement; each started from the full fit and its resample's best grid points)."""

    params, tokens, losses = (np.asarray(v, float) for v in (params, tokens, losses))
    if len(params) < 5:
        raise ValueError(f"a fit of 5 parameters needs at least 5 runs of distinct sizes and tokens; got {len(params)}")
    with threadpool_limits(1):  # L-BFGS's tiny steps: BLAS threads only contend (10x slower on busy cores)
        law, objective = fit_law(params, tokens, losses, delta)
        theta = (math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta)
        rng = np.random.default_rng(seed)
        boot = []
        for _ in range(bootstrap):
            pick = rng.integers(0, len(params), len(params))
            boot.append(fit_law(params[pick], tokens[pick], losses[pick], delta, starts=2, extra=[theta])[0])
    return Fit(law, boot, len(params), objective)


def best_member(law: Law, members: list[dict], compute: float | None, max_tokens: float | None = None) -> dict:
    """The member of a family (``{"params", "flops_per_token", ...}``) the law predicts lowest at
    ``compute`` FLOPs (a member's own ``compute`` where it has one: what a GPU-hour budget buys
    it), with its ``tokens`` and ``predicted`` loss added. ``max_tokens``: only members that
    train on at most that many tokens (one pass over a corpus: the law takes every token as
    fresh, which a repeated corpus is not; Muennighoff et al. 2023, "Scaling Data-Constrained
    Language Models"); a ValueError when none does."""
    trained = [(member, member.get("compute", compute) / member["flops_per_token"]) for member in members]
    scored = [
        {**member, "tokens": tokens, "predicted": float(law.loss(member["params"], tokens))}
        for member, tokens in trained
        if max_tokens is None or tokens <= max_tokens
    ]
    if not scored:
        raise ValueError(
            f"--max-tokens {max_tokens:.4g}: every model of the study trains on more at this budget "
            f"(the fewest {min(tokens for _, tokens in trained):.4g}); raise it or lower the budget"
        )
    return min(scored, key=lambda m: m["predicted"])


def best_tuned(table: list[dict]) -> dict[int, dict]:
    """Per model of a study (its parameter count) the row of its best tuning: the variant with
    the lowest final loss at the model's largest finished budget (a row of an unfinished trial
    only where the model has no finished one)."""
    best: dict[int, dict] = {}

    def rank(row: dict) -> tuple:
        done = row["status"] == "complete" and row["final_val"] is not None
        return (not done, -(row["flops"] or 0) if done else 0, row["final_val"] if done else 0)

    for row in table:
        if row["params"] and row["flops_per_token"]:
            if row["params"] not in best or rank(row) < rank(best[row["params"]]):
                best[row["params"]] = row
    return best


def study_points(table: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """``(params, tokens, losses)`` of a study's finished trials: per model and trial budget the
    lowest final loss (the best of the values that change neither, a learning rate) and the
    tokens that trial trained."""
    best: dict[tuple, dict] = {}
    for row in table:
        if row["status"] == "complete" and row["final_val"] is not None and row["params"] and row["tokens"]:
            key = (row["params"], json.dumps(row["budget"], sort_keys=True))
            if key not in best or row["final_val"] < best[key]["final_val"]:
                best[key] = row
    rows = [best[k] for k in sorted(best)]
    return [r["params"] for r in rows], [r["tokens"] for r in rows], [r["final_val"] for r in rows]
