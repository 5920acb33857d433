"""EleutherAI's lm-evaluation-harness on the LM task's models directly (``builder eval --tasks``,
a recipe's ``harness:`` section): :class:`BuilderLM` is a harness
model (``lm_eval.api.model.TemplateLM``) over a built model and its tokenizer — no export —
scoring log-likelihoods in length-sorted, right-padded batches of our forward pass and generating
with our KV-cached ``generate``. It tokenizes and truncates as lm-eval's own Hugging Face model
(``HFLM``) does, so a checkpoint and its ``builder export-hf`` folder score the same.

:func:`evaluate_tasks` runs tasks by name (lm-eval's, or YAML task files in ``task_path``, which
needs no download when their ``dataset_kwargs`` name local data files) and returns
``{"TASK/METRIC": value}``; :class:`HarnessCallback` does it every N steps of a run
(``yamlformer.recipes.training.run.run(recipe, callbacks=[HarnessCallback(["my_task"], 100)])``).
"""

from __future__ import annotations

import difflib
import logging
import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM

from yamlformer.recipes.data.tokenizers import from_state
from yamlformer.recipes.errors import RecipeError

#: the metrics a result keeps (lm-eval's own names), their standard errors left out
SKIP = ("alias", "samples", "sample_len")


class BuilderLM(TemplateLM):
    """A harness model over ``model`` (a built decoder) and ``tokenizer`` (ours)."""

    def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int | None = None, device=None):
        super().__init__()
        self.model, self.tok = model.eval(), tokenizer
        self._device = device or next(model.parameters()).device
        self.batch_size = batch_size
        self.max_length = max_length or model.spec.max_seq_len

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    @torch.no_grad()
    def _logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary at each position of each sequence (right-padded batch)."""
        longest = max(len(s) for s in sequences)
        batch = torch.zeros(len(sequences), longest, dtype=torch.long)
        for i, s in enumerate(sequences):
            batch[i, : len(s)] = torch.tensor(s)
        logits = self.model(batch.to(self._device)).float()  # (batch, seq, vocab)
        return [F.log_softmax(logits[i, : len(s)], dim=-1).cpu() for i, s in enumerate(sequences)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), whether it is the greedy continuation)`` for each
        request; the input is the last ``max_length`` tokens before the final one, as HFLM cuts it."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for first in range(0, len(order), self.batch_size):
            chunk = order[first : first + self.batch_size]
            inputs, targets = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                whole = (context + continuation)[-(self.max_length + 1) :]
                inputs.append(whole[:-1])
                targets.append(continuation[-len(whole) + 1 :])  # a continuation longer than the window: its tail
            for i, logprobs, continuation in zip(chunk, self._logprobs(inputs), targets):
                tail = logprobs[-len(continuation) :]  # (continuation, vocab)
                wanted = torch.tensor(continuation)
                score = tail.gather(1, wanted[:, None]).sum().item()
                results[i] = (score, bool((tail.argmax(-1) == wanted).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in windows of ``max_length`` (perplexity tasks)."""
        # optional extra: lm-eval (pip install 'yamlformer[harness]')
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        scores = []
        for (text,) in (r.args for r in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            pairs = [((None, None), context, continuation) for context, continuation in windows]
            scores.append(sum(score for score, _ in self._loglikelihood_tokens(pairs)))
        return scores

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations with our KV cache, cut at the first ``until`` string."""
        out = []
        for context, settings in (r.args for r in requests):
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(settings.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-max(1, self.max_length - new) :]
            tokens = self.model.generate(
                torch.tensor([ids], device=self._device),
                max_new_tokens=min(new, self.max_length - len(ids)),
                temperature=0.0,
                eos_token_id=self.eot_token_id,
                vocab_size=self.tok.vocab_size,  # never an embedding padding row: it would not decode
            )
            text = self.tok_decode(tokens[0, len(ids) :].tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def task_manager(tasks: list[str], task_path: str | Path | None = None, field: str = "--tasks"):
    """lm-eval's ``TaskManager`` that knows every one of ``tasks`` (the local ones in ``task_path``
    alone when it can: indexing lm-eval's thousands of task files takes seconds); an unknown task is a
    :class:`~yamlformer.recipes.errors.RecipeError` naming ``field``, with the closest known name."""

    # optional extra: lm-eval (pip install 'yamlformer[harness]')
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if task_path is not None and not Path(task_path).is_dir():
        where = "task_path" if field == "--tasks" else field.rsplit(".", 1)[0] + ".task_path"
        raise RecipeError(f"{where}: {task_path} is not a folder of lm-eval task files")
    manager = None
    if task_path:
        manager = TaskManager(include_path=str(task_path), include_defaults=False)
    if manager is None or not all(manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=str(task_path) if task_path else None)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(manager.all_tasks), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        where = f" in {task_path} nor" if task_path else ""
        raise RecipeError(f"{field}: no task {unknown[0]!r}{where} among lm-eval's own{hint}")
    return manager


def evaluate_tasks(
    lm, tasks: list[str], task_path: str | Path | None = None, limit: int | None = None, num_fewshot=None, manager=None
) -> dict[str, float]:
    """Run lm-eval's ``simple_evaluate`` on ``lm`` (any harness model); ``{"TASK/METRIC": value}``.
    ``manager``: a :func:`task_manager` already made for these tasks."""
    # optional extra: lm-eval (pip install 'yamlformer[harness]')
    from lm_eval import simple_evaluate

    manager = manager or task_manager(tasks, task_path)
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=0,
        log_samples=False,
        verbosity="WARNING",
    )
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            name = key.split(",")[0]
            if name in SKIP or "_stderr" in name or not isinstance(value, (int, float)):
                continue
            metrics[f"{task}/{name}"] = float(value) if math.isfinite(value) else value
    return metrics


class HarnessCallback(L.Callback):
    """lm-eval ``tasks`` on the training model every ``every_n_steps`` steps, each metric logged as
    ``harness/TASK/METRIC`` beside the losses, printed in one line, and kept in :attr:`results` by
    step. Every rank scores the same requests (a sharded model's forward is collective); rank 0
    logs and prints. The tasks are looked up when fitting starts, so a wrong name stops the run
    before its first step, naming ``field``."""

    def __init__(
        self,
        tasks,
        every_n_steps: int,
        task_path=None,
        limit=None,
        num_fewshot=None,
        batch_size: int = 16,
        field: str = "harness.tasks",
    ):
        self.tasks, self.every = list(tasks), every_n_steps
        self.task_path, self.limit, self.num_fewshot, self.batch_size = task_path, limit, num_fewshot, batch_size
        self.field = field
        self.manager = None
        self.results: dict[int, dict[str, float]] = {}

    @classmethod
    def from_section(cls, section, recipe_file: Path) -> HarnessCallback:
        """The callback a recipe's ``harness:`` section asks for (its ``task_path`` relative to the recipe)."""
        task_path = None if section.task_path is None else Path(recipe_file).parent / section.task_path
        return cls(
            section.tasks, section.every_n_steps, task_path, section.limit, section.num_fewshot, section.batch_size
        )

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.manager is None:
            self.manager = task_manager(self.tasks, self.task_path, self.field)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 0 or step % self.every or step in self.results:
            return

        model = pl_module.model
        lm = BuilderLM(model, from_state(pl_module.meta["tokenizer"]), self.batch_size)
        self.results[step] = evaluate_tasks(lm, self.tasks, self.task_path, self.limit, self.num_fewshot, self.manager)
        model.train()
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics({f"harness/{k}": v for k, v in self.results[step].items()}, step=step)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in self.results[step].items())
        bar = trainer.progress_bar_callback  # its print clears the bar first, so the line stands alone
        (bar.print if bar is not None else print)(f"harness at step {step}: {shown}")
