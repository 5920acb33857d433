"""``task: preference``: each loss against a value computed by hand and against TRL's own loss
functions, the reference that switches adapters off is the base, packed pairs score what each
sequence alone scores, bad records and options are one located line, the estimate counts a
frozen reference, and a short run trains the held-out pairs' accuracy up."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from recipe_helpers import TINY_SPEC

from yamlformer.blocks.linear import adapter_parameters, adapters_disabled
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.cli import main
from yamlformer.recipes.data.chat import ChatFormat
from yamlformer.recipes.data.pairs import PairRows, encode_pairs
from yamlformer.recipes.data.tokenizers import CharTokenizer
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.tasks.preference import PreferenceSection
from yamlformer.recipes.tasks.preference.losses import PairLogps, log1mexp, preference_loss
from yamlformer.recipes.tasks.preference.training import Reference, batch_logps

REPO = Path(__file__).resolve().parents[1]

# two pairs: summed response log-probabilities, token counts, and the reference's sums
POLICY = PairLogps(
    torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -3.0]), torch.tensor([2.0, 3.0]), torch.tensor([4.0, 2.0])
)
REFERENCE = PairLogps(
    torch.tensor([-4.5, -5.0]), torch.tensor([-4.0, -3.5]), torch.tensor([2.0, 3.0]), torch.tensor([4.0, 2.0])
)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _loss(**options):
    return preference_loss(PreferenceSection(**options), POLICY, REFERENCE)


def test_dpo_is_minus_log_sigmoid_of_beta_times_the_log_ratio_difference():
    loss, metrics = _loss(loss="dpo", beta=0.5)
    # pair 0: (-4 + 4.5) - (-5 + 4) = 1.5; pair 1: (-6 + 5) - (-3 + 3.5) = -1.5
    expected = (-math.log(_sigmoid(0.75)) - math.log(_sigmoid(-0.75))) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["rewards/chosen"]) == pytest.approx((0.5 * 0.5 + 0.5 * -1.0) / 2)
    assert float(metrics["rewards/rejected"]) == pytest.approx((0.5 * -1.0 + 0.5 * 0.5) / 2)
    assert float(metrics["rewards/accuracy"]) == 0.5 and float(metrics["logps/chosen"]) == -5.0
    smoothed, _ = _loss(loss="dpo", beta=0.5, label_smoothing=0.1)
    conservative = [-(0.9 * math.log(_sigmoid(z))) - 0.1 * math.log(_sigmoid(-z)) for z in (0.75, -0.75)]
    assert float(smoothed) == pytest.approx(sum(conservative) / 2, rel=1e-6)


def test_ipo_squares_the_length_normalised_margin_less_one_over_two_beta():
    loss, _ = _loss(loss="ipo", beta=0.25)
    deltas = [0.5 / 2 - (-1.0) / 4, -1.0 / 3 - 0.5 / 2]
    assert float(loss) == pytest.approx(sum((d - 2.0) ** 2 for d in deltas) / 2, rel=1e-6)


def test_simpo_reads_mean_token_log_probabilities_against_a_margin():
    loss, metrics = _loss(loss="simpo", beta=2.0, simpo_gamma=0.5)
    means = [(-2.0, -1.25), (-2.0, -1.5)]
    expected = [-math.log(_sigmoid(2.0 * (c - r) - 0.5)) for c, r in means]
    assert float(loss) == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert float(metrics["rewards/chosen"]) == pytest.approx(-4.0) and float(metrics["logps/chosen"]) == -2.0


def test_orpo_adds_the_odds_ratio_term_to_the_chosen_answers_nll():
    loss, metrics = _loss(loss="orpo", orpo_lambda=0.2)
    nll = 10.0 / 5.0  # the chosen responses' tokens: (4 + 6) / (2 + 3)
    terms = []
    for c, r in ((-2.0, -1.25), (-2.0, -1.5)):
        log_odds = (c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r)))
        terms.append(math.log(_sigmoid(log_odds)))
    assert float(loss) == pytest.approx(nll - 0.2 * sum(terms) / 2, rel=1e-6)
    assert float(metrics["nll_loss"]) == pytest.approx(nll)
    x = torch.tensor([-1e-3, -0.5, -0.7, -3.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-9, atol=0)
    assert float(log1mexp(torch.tensor(-40.0, dtype=torch.float64))) == pytest.approx(-math.exp(-40.0), rel=1e-9)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_simpo_and_orpo_equal_trls_own_loss_functions():
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    chosen, rejected = POLICY.means()
    device = types.SimpleNamespace(device="cpu")
    cpo = types.SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.1, accelerator=device
    )
    losses, chosen_rewards, _ = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    ours, metrics = _loss(loss="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1)
    torch.testing.assert_close(ours, losses.mean())
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_rewards.mean())
    ratio_losses, _, _, _, _ = ORPOTrainer.odds_ratio_loss(
        types.SimpleNamespace(beta=0.3, accelerator=device), chosen, rejected
    )
    ours, metrics = _loss(loss="orpo", orpo_lambda=0.3)
    torch.testing.assert_close(ours, metrics["nll_loss"] - ratio_losses.mean())


def test_an_option_another_loss_reads_is_refused_at_its_line(tmp_path):
    with pytest.raises(ValueError, match="loss dpo does not read simpo_gamma"):
        PreferenceSection(loss="dpo", simpo_gamma=1.0)
    recipe = yaml.safe_load(_recipe(tmp_path).read_text())
    recipe["preference"] = {"loss": "orpo", "label_smoothing": 0.1}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(Exception, match=r"bad\.yaml:\d+:\d+: preference\.label_smoothing: loss orpo does not read"):
        from yamlformer.recipes.tasks import load_recipe

        load_recipe(path)


def test_the_reference_of_an_adapted_model_is_its_base():
    spec = load_spec(
        REPO / "specs" / "tiny" / "llama.yaml",
        overrides={"adapters": {"type": "lora", "rank": 4, "targets": "all-linear"}},
    )
    model = build_model(spec, init_seed=0).eval()
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.1 * torch.randn(p.shape))
    base = build_model(load_spec(REPO / "specs" / "tiny" / "llama.yaml"), init_seed=0).eval()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".adapter." not in k})
    x = torch.randint(0, spec.vocab_size, (2, 12))
    assert not torch.allclose(model(x), base(x))
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    assert not torch.allclose(model(x), base(x))  # and on again after
    reference = Reference(needed=True)
    reference.capture(model)
    assert reference.copy is None  # no second copy of an adapted model


def test_the_reference_of_adapters_loaded_trained_is_the_starting_policy():
    spec = load_spec(
        REPO / "specs" / "tiny" / "llama.yaml",
        overrides={"adapters": {"type": "lora", "rank": 4, "targets": "all-linear"}},
    )
    model = build_model(spec, init_seed=0).eval()
    adapters = adapter_parameters(model)
    with torch.no_grad():
        for p in adapters.values():
            p.add_(0.1 * torch.randn(p.shape))  # an SFT run's adapters
    x = torch.randint(0, spec.vocab_size, (2, 12))
    start = model(x).detach()
    reference = Reference(needed=True)
    reference.capture(model)
    assert reference.copy is None and reference.adapters_at_start is not None
    with torch.no_grad():
        for p in adapters.values():
            p.add_(0.1 * torch.randn(p.shape))  # trained on
    trained = model(x).detach()
    with reference.model(model) as ref:
        torch.testing.assert_close(ref(x), start, rtol=0, atol=0)
    torch.testing.assert_close(model(x), trained, rtol=0, atol=0)  # its own values again after


def _pairs_file(tmp_path: Path, n: int = 40, seed: int = 0) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rng = np.random.default_rng(seed)
    path = tmp_path / "pairs.jsonl"
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.choice(words, 2, replace=False)
            f.write(json.dumps({"prompt": f"say {a}", "chosen": f"{a} {a}", "rejected": f"{b} no"}) + "\n")
    return path


def _char_chat() -> ChatFormat:
    return ChatFormat(CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True))


def test_packed_pairs_score_what_each_sequence_scores_alone(tmp_path):
    chat = _char_chat()
    pairs = encode_pairs(_pairs_file(tmp_path, n=6), chat, seq_len=255)
    spec = load_spec(REPO / "specs" / "tiny" / "llama.yaml", overrides={"vocab_size": 64, "max_seq_len": 256})
    model = build_model(spec, init_seed=0).eval()
    packed = PairRows(pairs, 255, chat.tokenizer.eos_id, packing=True)
    alone = PairRows(pairs, 255, chat.tokenizer.eos_id, packing=False)
    assert len(packed) < len(alone) == 6
    with torch.no_grad():
        a = batch_logps(model, packed.batch(np.arange(len(packed))), select=False)
        b = batch_logps(model, alone.batch(np.arange(6)), select=True)
    order = [i for row in packed.records for i in row]
    for field in ("chosen", "rejected", "chosen_tokens", "rejected_tokens"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field)[order], rtol=1e-5, atol=1e-5)
    # each side's tokens are its answer's (and the EOS that ends it), never the prompt's
    assert b.chosen_tokens.tolist() == [len(p.chosen.ids) - p.chosen.starts[0] for p in pairs]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "chosen": "b"}', r"pairs\.jsonl:2: no rejected"),
        ('{"prompt": "a", "chosen": "b", "rejected": 3}',
         r"pairs\.jsonl:2: rejected is not a string, as the other answer is"),
        ('{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
         '"rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "c"}]}',
         r"pairs\.jsonl:2: chosen and rejected do not share a prompt"),
        ("[1, 2]", r"pairs\.jsonl:2: a JSON array, not a preference pair"),
        ('{"prompt": "a", "chosen": "' + "b" * 200 + '", "rejected": "c"}',
         r"pairs\.jsonl:2: the pair is \d+ \+ \d+ tokens"),
    ],
    ids=["no-rejected", "not-a-string", "no-shared-prompt", "not-an-object", "too-long"],
)  # fmt: skip
def test_a_bad_pair_is_one_line_naming_its_file_and_line(line, message, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(RecipeError, match=message) as caught:
        encode_pairs(path, _char_chat(), seq_len=127)
    assert "\n" not in str(caught.value) and "bbbbbbbb" not in str(caught.value)


def test_conversational_pairs_share_their_prompt(tmp_path):
    chat = _char_chat()
    user = {"role": "user", "content": "say a"}
    path = tmp_path / "pairs.jsonl"
    a, b = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}
    records = [
        {"prompt": [user], "chosen": [a], "rejected": [b]},
        {"chosen": [user, a], "rejected": [user, b]},
        {"prompt": "say a", "chosen": "a", "rejected": "b"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    first, second, third = encode_pairs(path, chat, seq_len=127)
    for pair in (second, third):
        for side in ("chosen", "rejected"):
            np.testing.assert_array_equal(getattr(pair, side).ids, getattr(first, side).ids)
            np.testing.assert_array_equal(getattr(pair, side).trained, getattr(first, side).trained)


TINY = {**TINY_SPEC, "max_seq_len": 128}  # the tiny recipes' spec, with room for a pair


def _recipe(tmp_path: Path, **sections) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = {
        "task": "preference",
        "name": "tiny-preference",
        "model": {"spec": TINY},
        "data": {"file": str(_pairs_file(tmp_path, n=48)), "seq_len": 127, "batch_size": 4,
                 "cache_dir": str(tmp_path / "cache")},
        "tokenizer": {"vocab_size": 300},
        "preference": {"loss": "dpo", "beta": 0.1},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "trainer": {"max_steps": 12, "val_check_interval": 6, "limit_val_batches": 2, "checkpoint_every_n_steps": 6,
                    "log_every_n_steps": 2, "accelerator": "cpu", "precision": "32", "devices": 1,
                    "output_dir": str(tmp_path / "run")},
    }  # fmt: skip
    for name, value in sections.items():
        recipe[name] = {**recipe[name], **value} if isinstance(recipe.get(name), dict) else value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_the_estimate_counts_a_frozen_reference_and_no_adapted_one(tmp_path):
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.dry_run import run_estimate
    from yamlformer.recipes.training.resolved import resolve_run

    sizes = {}
    for loss in ("dpo", "simpo"):
        path = _recipe(tmp_path, preference={"loss": loss, "beta": 0.1})
        run = resolve_run(load_recipe(path))
        est = run_estimate(run)
        sizes[loss] = est.memory
    assert sizes["dpo"].reference == 4 * build_model(run.spec, device="meta").n_params()  # fp32 weights
    assert sizes["simpo"].reference == 0
    assert sizes["dpo"].training_total - sizes["simpo"].training_total == sizes["dpo"].reference


def test_a_short_run_trains_the_held_out_accuracy_up_and_keeps_its_reference(tmp_path, capsys):
    path = _recipe(tmp_path)
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "held out, before training: loss 0.6931, reward accuracy 0.0%" in out
    line = next(s for s in out.splitlines() if s.startswith("held out ("))
    after = float(line.split("reward accuracy 0.0% -> ")[1].split("%")[0])
    assert after >= 75.0, line
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert not any("reference" in k for k in checkpoint["state_dict"])  # the frozen copy is no state
    metrics = (tmp_path / "run").rglob("metrics.csv")
    header = next(metrics).read_text().splitlines()[0]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen"):
        assert name in header
    assert main(["eval", str(tmp_path / "run" / "checkpoints" / "last.ckpt")]) == 0
    assert "held-out pairs: loss" in capsys.readouterr().out


def test_a_resumed_run_trains_as_an_unbroken_one(tmp_path):
    """A full fine-tuning run stopped at step 6 and resumed: the same losses and weights at step 12
    as a run that never stopped (its frozen reference is the starting weights both times)."""
    from recipe_helpers import assert_same_run

    constant = {"type": "constant", "warmup_steps": 2}  # the stopped run's schedule is the whole one's
    whole = _recipe(tmp_path / "whole", schedule=constant)
    assert main(["train", str(whole)]) == 0
    broken = _recipe(tmp_path / "broken", schedule=constant)
    assert main(["train", str(broken), "--set", "trainer.max_steps=6"]) == 0
    assert main(["train", str(broken)]) == 0
    assert_same_run(
        tmp_path / "whole" / "run" / "checkpoints" / "last.ckpt",
        tmp_path / "broken" / "run" / "checkpoints" / "last.ckpt",
    )


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_rank_reads_as_many_held_out_batches(world, tmp_path):
    """A sharded model's forward is a collective: a rank with no validation batch while another had
    one hung both (a two-process FSDP run with 2 held-out rows of 2 a batch)."""
    from yamlformer.recipes.data.instructions import ValRows

    rows = PairRows(encode_pairs(_pairs_file(tmp_path, n=5), _char_chat(), 127), 127, 0, packing=False)
    for n_batches in (1, 2, 3, 8):
        counts = {len(list(ValRows(rows, 2, n_batches, rank, world))) for rank in range(world)}
        assert counts == {len(ValRows(rows, 2, n_batches, 0, world))}, (n_batches, counts)


@pytest.mark.parametrize("task", ["sft", "preference"])
def test_a_char_tokenizer_without_init_from_is_fitted_on_the_rendered_records(task, tmp_path, capsys):
    """Its vocabulary was asked of an LM corpus the recipe has not (an internal error); the table
    holds the template's framing too ('#' is in no record), which a table of the contents could not encode."""
    path = _recipe(tmp_path, trainer={"max_steps": 2, "val_check_interval": 2, "checkpoint_every_n_steps": 2})
    recipe = yaml.safe_load(path.read_text())
    recipe["tokenizer"] = {"type": "char"}
    if task == "sft":
        recipe["task"] = "sft"
        del recipe["preference"]
        records = tmp_path / "records.jsonl"
        records.write_text("".join(json.dumps({"prompt": f"say {w}", "response": w}) + "\n" for w in ["ab", "cd"] * 8))
        recipe["data"]["file"] = str(records)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["train", str(path), "--dry-run"]) == 0
    assert "char: the rendered records'" in capsys.readouterr().out
    assert main(["train", str(path)]) == 0
    from yamlformer.builder.checkpoints import read_meta

    chars = read_meta(tmp_path / "run" / "checkpoints" / "last.ckpt")["builder"]["tokenizer"]["chars"]
    assert "#" in chars and ":" in chars


def test_a_precomputed_reference_trains_as_the_live_one_without_a_copy(tmp_path, capsys):
    """``preference.precompute_reference``: one pass of the starting weights before training, cached
    by a fingerprint of the pairs and those weights; the same losses as the frozen copy's, none in
    memory (the estimate counts none); other pairs are another table."""
    from sharded_helpers import assert_same_losses, losses

    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.dry_run import run_estimate
    from yamlformer.recipes.training.resolved import resolve_run

    short = {"max_steps": 6, "val_check_interval": 3, "checkpoint_every_n_steps": 3}
    live = _recipe(tmp_path / "live", trainer=short, data={"cache_dir": str(tmp_path / "cache")})
    assert main(["train", str(live)]) == 0
    pre = _recipe(
        tmp_path / "pre", trainer=short, data={"cache_dir": str(tmp_path / "cache")},
        preference={"precompute_reference": True},
    )  # fmt: skip
    run = resolve_run(load_recipe(pre), pre)
    assert run_estimate(run).memory.reference == 0
    capsys.readouterr()
    assert main(["train", str(pre)]) == 0
    assert "reference log-probabilities: 48 pairs computed, cached at" in capsys.readouterr().out
    assert_same_losses(losses(tmp_path / "pre" / "run"), losses(tmp_path / "live" / "run"), atol=1e-5)
    assert main(["train", str(pre), "--fresh"]) == 0  # the same pairs and weights: the table read back
    assert "reference log-probabilities: read from" in capsys.readouterr().out
    _pairs_file(tmp_path / "pre", n=48, seed=1)  # other pairs: another fingerprint, computed again
    assert main(["train", str(pre), "--fresh"]) == 0
    assert "pairs computed" in capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "reference-logps").glob("*.npz"))) == 2
    with pytest.raises(ValueError, match="loss simpo has no reference model"):
        PreferenceSection(loss="simpo", precompute_reference=True)


def test_adapters_resume_and_export_as_sfts_do(tmp_path):
    """A LoRA preference run stopped at step 4 and resumed ends as an unbroken one (its reference:
    the adapters switched off, both times); its checkpoint exports as a PEFT folder ``peft`` loads
    onto the base's export, and merged, both with the checkpoint's logits."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from recipe_helpers import assert_same_run
    from transformers import AutoModelForCausalLM

    from yamlformer.builder.checkpoints import load_model
    from yamlformer.builder.hf import save_weights

    lora = {"adapters": {"type": "lora", "rank": 4, "alpha": 8, "targets": ["attention", "ffn"]}}
    short = {"max_steps": 6, "val_check_interval": 2, "checkpoint_every_n_steps": 2}
    constant = {"type": "constant", "warmup_steps": 2}
    whole = _recipe(tmp_path / "whole", model=lora, trainer=short, schedule=constant)
    assert main(["train", str(whole)]) == 0
    broken = _recipe(tmp_path / "broken", model=lora, trainer=short, schedule=constant)
    assert main(["train", str(broken), "--set", "trainer.max_steps=4"]) == 0
    assert main(["train", str(broken)]) == 0
    last = tmp_path / "whole" / "run" / "checkpoints" / "last.ckpt"
    assert_same_run(last, tmp_path / "broken" / "run" / "checkpoints" / "last.ckpt")

    model, _ = load_model(last)
    model.eval()
    base = tmp_path / "base"
    base.mkdir()
    (base / "spec.yaml").write_text(yaml.safe_dump({**model.spec.model_dump(mode="json"), "adapters": None}))
    save_weights({k: v for k, v in model.state_dict().items() if ".adapter." not in k}, base / "model.safetensors")
    assert main(["export-hf", str(base / "spec.yaml"), "-o", str(tmp_path / "hf-base")]) == 0
    assert main(["export-hf", str(last), "--adapters-only", "-o", str(tmp_path / "peft")]) == 0
    assert main(["export-hf", str(last), "--merge", "-o", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, model.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(ids)
        assert float((ours - model(ids)).abs().max()) == 0
        torch.testing.assert_close(peft_model(ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=1e-5)


def test_eval_compares_with_the_starting_weights_the_run_recorded_and_an_older_checkpoint_still_does(tmp_path):
    """A run records the weights it started from (``starting_weights``: its ``model.init_from``'s,
    absolute; None: drawn, seeded), and ``builder eval`` takes its reference from that record
    instead of resolving the recipe again. A checkpoint written before runs recorded it evaluates
    as it did then (its recipe's ``model.init_from`` found again from its recipe file)."""
    from yamlformer.recipes.tasks.preference.training import evaluate_checkpoint
    from yamlformer.recipes.trained import load_trained

    short = {"max_steps": 2, "val_check_interval": 2, "checkpoint_every_n_steps": 2}
    assert main(["train", str(_recipe(tmp_path / "first", trainer=short))]) == 0
    start = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    model = {"spec": None, "init_from": "../first/run/checkpoints/last.ckpt"}  # relative to the recipe
    assert main(["train", str(_recipe(tmp_path / "second", trainer=short, model=model))]) == 0
    assert load_trained(start, "cpu")[2]["starting_weights"] is None
    model, tokenizer, meta = load_trained(tmp_path / "second" / "run" / "checkpoints" / "last.ckpt", "cpu")
    assert meta["starting_weights"] == str(start.resolve())
    args = types.SimpleNamespace(batch_size=None, all=True, max_batches=None)
    recorded = evaluate_checkpoint(model, tokenizer, meta, args)
    older = {key: value for key, value in meta.items() if key != "starting_weights"}
    assert evaluate_checkpoint(model, tokenizer, older, args) == recorded
    drawn = evaluate_checkpoint(model, tokenizer, dict(meta, starting_weights=None), args)
    assert drawn["margin"] != recorded["margin"]  # the record is what eval reads
