"""The preference losses of ``task: preference``, defined as TRL defines them (``DPOTrainer``,
``CPOTrainer``, ``ORPOTrainer``), from per-sequence log-probabilities of the responses.

Notation: for a pair, ``c``/``r`` the summed log-probabilities of the chosen and the rejected
response's tokens under the policy, ``|c|``/``|r|`` their token counts, ``c0``/``r0`` the same under
the reference model, ``σ`` the logistic function, ``ε`` ``label_smoothing``.

* **dpo** (Rafailov et al. 2023; TRL's ``loss_type="sigmoid"``, with cDPO's label smoothing):
  ``Δ = (c - c0) - (r - r0)``, loss ``-(1 - ε) log σ(βΔ) - ε log σ(-βΔ)``.
* **ipo** (Azar et al. 2023, eq. 17, TRL's length-normalised form): ``Δ = (c - c0)/|c| - (r - r0)/|r|``,
  loss ``(Δ - 1/(2β))²``.
* **simpo** (Meng et al. 2024; TRL's ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``):
  no reference; ``Δ = c/|c| - r/|r| - γ/β``, loss ``-(1 - ε) log σ(βΔ) - ε log σ(-βΔ)``.
* **orpo** (Hong et al. 2024; TRL's ``ORPOTrainer``, whose ``beta`` is the paper's λ): no reference;
  with ``a = c/|c|``, ``b = r/|r|``, the log odds ratio ``(a - b) - (log(1 - e^a) - log(1 - e^b))``;
  loss ``NLL - λ log σ(log odds)``, NLL the chosen responses' mean token loss.

Rewards (what is logged, as TRL logs them): ``β(c - c0)`` and ``β(r - r0)`` for dpo and ipo,
``β a`` and ``β b`` for simpo, ``λ a`` and ``λ b`` for orpo; accuracy is the share of pairs whose chosen
reward is the greater, the margin their difference; ``logps/*`` are the log-probabilities the loss
reads (sums for dpo and ipo, per-token means for simpo and orpo).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

#: the losses that compare against a reference model
NEEDS_REFERENCE = ("dpo", "ipo")
#: the losses that read per-token mean log-probabilities
AVERAGED = ("simpo", "orpo")


@dataclasses.dataclass
class PairLogps:
    """Per pair ``(pairs,)``: the summed log-probabilities of the chosen and rejected responses and
    their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


def pair_logps(token_logps: torch.Tensor, segments: torch.Tensor, pairs: int) -> PairLogps:
    """``token_logps`` ``(n,)`` of the scored tokens, each of sequence ``segments`` ``(n,)``
    (``2 * pair + 1`` for a rejected response's, ``2 * pair`` for a chosen one's), summed per pair."""
    sums = token_logps.new_zeros(2 * pairs).index_add_(0, segments, token_logps)
    counts = token_logps.new_zeros(2 * pairs).index_add_(0, segments, torch.ones_like(token_logps))
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, branched at ``-ln 2`` (Mächler 2012, TRL's)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def preference_loss(objective, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of a batch of pairs (module doc): the mean over pairs, and the metrics
    as detached device tensors (means over the pairs, ``pairs`` their count)."""
    loss_name, beta, smoothing = objective.loss, objective.beta, objective.label_smoothing
    extra = {}
    if loss_name in NEEDS_REFERENCE:
        if reference is None:
            raise ValueError(f"the {loss_name} loss compares against a reference model; none given")
        chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if loss_name == "dpo":
            losses = _smoothed_sigmoid(beta * (chosen_ratio - rejected_ratio), smoothing)
        else:
            delta = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(
                min=1
            )
            losses = (delta - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        chosen_logps, rejected_logps = policy.chosen, policy.rejected
    elif loss_name == "simpo":
        chosen_logps, rejected_logps = policy.means()
        losses = _smoothed_sigmoid(beta * (chosen_logps - rejected_logps) - objective.simpo_gamma, smoothing)
        chosen_rewards, rejected_rewards = beta * chosen_logps, beta * rejected_logps
    elif loss_name == "orpo":
        chosen_logps, rejected_logps = policy.means()
        log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
        ratio = F.logsigmoid(log_odds)
        nll = -policy.chosen.sum() / policy.chosen_tokens.sum().clamp(min=1)
        lam = objective.orpo_lambda
        losses = nll - lam * ratio
        chosen_rewards, rejected_rewards = lam * chosen_logps, lam * rejected_logps
        extra = {
            "nll_loss": nll.detach(),
            "log_odds_ratio": ratio.detach().mean(),
            "log_odds": log_odds.detach().mean(),
        }
    else:
        raise ValueError(f"unknown preference loss {loss_name!r}")
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
        **extra,
    }
    return losses.mean(), metrics
