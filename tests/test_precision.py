"""Precision on every path, the same on every machine: what ``auto`` resolves to (CPU features and a
CUDA device patched both ways), clipping with fused AdamW under each precision against PyTorch's
AMP recipe, an fp16 overflow skipped, and a precision x strategy x task matrix of tiny runs (a few
steps, finite losses, a checkpoint, a resume that continues the losses, ``eval`` and
``generate``). Every row forces its precision: nothing here depends on the CPU it runs on."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from precision_helpers import TASKS, eval_and_generate_args, task_recipe
from recipe_helpers import tiny_recipe
from torch import nn

from yamlformer.recipes.training import precision

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")


# -- what auto means ------------------------------------------------------------------------------


@pytest.fixture
def on_cpu(monkeypatch):
    """A CPU-only machine whose bf16 instruction set the test sets (``on_cpu("AMX")``)."""
    monkeypatch.setattr(precision, "on_cuda", lambda accelerator: False)

    def with_features(native):
        monkeypatch.setattr(precision, "cpu_bf16", lambda: native)

    return with_features


@pytest.mark.parametrize("native", ["AMX", "AVX512-BF16"])
def test_auto_on_a_cpu_with_native_bf16_is_bf16_autocast(on_cpu, native):
    on_cpu(native)
    chosen, note = precision.resolve_precision("auto", "cpu")
    assert chosen == "bf16-mixed" and f"this CPU has {native}" in note and "measured" in note
    for explicit in PRECISIONS:  # an explicit precision is kept, without a word
        assert precision.resolve_precision(explicit, "cpu") == (explicit, None)


def test_auto_on_a_cpu_without_native_bf16_is_fp32_and_explicit_bf16_warns(on_cpu):
    on_cpu(None)
    chosen, note = precision.resolve_precision("auto", "cpu")
    assert chosen == "32" and "neither AMX nor AVX512-BF16" in note
    for explicit in ("bf16-mixed", "bf16-true"):
        chosen, note = precision.resolve_precision(explicit, "cpu")
        assert chosen == explicit and note.startswith("warning:") and "emulated" in note
    assert precision.resolve_precision("16-mixed", "cpu") == ("16-mixed", None)


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_a_faked_cuda_device(monkeypatch, native):
    monkeypatch.setattr(precision, "on_cuda", lambda accelerator: accelerator in ("auto", "gpu", "cuda"))
    monkeypatch.setattr(precision, "cuda_bf16", lambda: native)
    monkeypatch.setattr(precision, "cpu_bf16", lambda: pytest.fail("a GPU run asked the CPU's features"))
    chosen, note = precision.resolve_precision("auto", "auto")
    assert chosen == ("bf16-mixed" if native else "32")
    assert note is None if native else "no native bf16" in note
    assert precision.resolve_precision("16-mixed", "cuda") == ("16-mixed", None)


def test_cpu_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {})
    for flags, expected in (
        ({"avx512f", "avx512_bf16"}, "AVX512-BF16"),
        ({"amx_tile", "amx_bf16"}, "AMX"),
        ({"avx2"}, None),
    ):
        monkeypatch.setattr(precision, "_cpuinfo_flags", lambda flags=flags: flags)
        assert precision.cpu_bf16() == expected


@pytest.mark.parametrize("native", ["AMX", None])
def test_a_run_with_auto_trains_in_what_the_patched_cpu_resolves_to(tmp_path, capsys, monkeypatch, native):
    from yamlformer.recipes.training.run import run

    monkeypatch.setattr(precision, "on_cuda", lambda accelerator: False)
    monkeypatch.setattr(precision, "cpu_bf16", lambda: native)
    run(tiny_recipe(tmp_path, trainer={"max_steps": 2, "precision": "auto"}), samples=False)
    out = capsys.readouterr().out
    expected = "bf16-mixed" if native else "32"
    assert f"precision auto: {'bf16-mixed' if native else 'fp32'}" in out
    meta = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["builder"]
    assert meta["recipe"]["trainer"]["precision"] == expected  # the checkpoint records what ran


# -- clipping with fused AdamW, against PyTorch's AMP recipe --------------------------------------


#: AdamW's eps, large: Adam's step is otherwise invariant to the gradients' scale (clipping would not
#: show) and to their rounding (bf16 autocast would not show); with eps 1 the step is about lr x grad
EPS = 1.0


class _Tiny(L.LightningModule):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        from yamlformer.builder.optim.configs import AdamWConfig
        from yamlformer.recipes.optim.torch_optimizers import adamw

        optimizer = adamw(AdamWConfig(lr=0.05, eps=EPS, betas=(0.9, 0.999)), [{"params": list(self.parameters())}])
        assert optimizer.defaults.get("fused"), "the fused kernel is the case under test"
        return optimizer


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def _lightning_step(plugin, clip: float, steps: int = 1) -> nn.Module:
    module = _Tiny()
    batch = _batch()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch] * steps, batch_size=None))
    return module.net


def _reference_step(kind: str, clip: float, scaler=None) -> tuple[nn.Module, float]:
    """One step by the book: autocast forward (bf16-true: a bf16 model), (scaled) backward, unscale,
    clip, step (the same fused AdamW: the order of the steps is under test). Returns the model and the
    gradient norm before clipping."""
    net = _Tiny().net
    x, y = _batch()
    if kind == "bf16-true":
        net, x = net.to(torch.bfloat16), x.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, eps=EPS, fused=True)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(kind)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False):
        loss = F.cross_entropy(net(x).float(), y)
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=kind == "16-mixed")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))
    scaler.step(optimizer)
    scaler.update()
    return net, norm


def _update(net: nn.Module) -> torch.Tensor:
    """How far one step moved every parameter, flattened (fp32)."""
    start = _Tiny().net
    return torch.cat(
        [(p.detach().float() - s.detach().float()).flatten() for p, s in zip(net.parameters(), start.parameters())]
    )


@pytest.mark.parametrize("kind", PRECISIONS)
def test_clipping_with_fused_adamw_matches_the_amp_recipe(kind):
    clip = 0.05
    ours = _update(_lightning_step(precision.lightning_plugin(kind, "cpu"), clip))
    reference, norm = _reference_step(kind, clip)
    assert norm > 4 * clip, "the clip must bind for the test to mean anything"
    assert ours.abs().min() > 0, "every parameter moved"
    torch.testing.assert_close(ours, _update(reference), rtol=1e-5, atol=1e-8)
    unclipped = _update(_reference_step(kind, math.inf)[0])
    assert not torch.allclose(ours, unclipped, rtol=0.1)  # clipping shaped the step
    if kind != "32":  # and the step was taken in the precision asked for, not in fp32
        fp32 = _update(_reference_step("32", clip)[0])
        assert not torch.allclose(ours, fp32, rtol=1e-3, atol=0), kind


def test_an_fp16_overflow_skips_the_fused_step_and_lowers_the_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # every gradient overflows fp16
    plugin = precision.ClippingMixedPrecision("16-mixed", "cpu", scaler=scaler)
    ours = _lightning_step(plugin, clip=0.05)
    for p, s in zip(ours.parameters(), _Tiny().net.parameters()):
        assert torch.equal(p, s)  # the step was skipped, not applied with inf or unscaled twice
    assert scaler.get_scale() == 2.0**39


def test_fp16_takes_several_steps_with_clipping_and_its_scale_grows():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ours = _lightning_step(precision.ClippingMixedPrecision("16-mixed", "cpu", scaler=scaler), clip=0.05, steps=4)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    assert scaler.get_scale() == 2.0**10  # no overflow in four steps: grown twice


# -- the precision x strategy x task matrix -------------------------------------------------------

#: strategies: (trainer settings, processes); 16-mixed is refused under fsdp (no fp16 loss scaling there)
STRATEGIES = {
    "one": ({}, 1),
    "ddp2": ({"strategy": "ddp", "devices": 2}, 2),
    "fsdp2": ({"strategy": "fsdp", "devices": 2}, 2),
    "tp2xfsdp2": ({"strategy": "fsdp", "devices": 4, "tensor_parallel": 2}, 4),
}
#: the rows the default suite runs: every precision on the LM, and bf16 autocast (the precision
#: `auto` picks on bf16 hardware) on every task; the rest are marked slow
DEFAULT_ROWS = {*((p, "one", "lm") for p in PRECISIONS), *(("bf16-mixed", "one", t) for t in TASKS)}


def _rows():
    for strategy in STRATEGIES:
        for kind in PRECISIONS:
            if kind == "16-mixed" and strategy.startswith(("fsdp", "tp")):
                continue
            for task in TASKS:
                row = (kind, strategy, task)
                marks = () if row in DEFAULT_ROWS else (pytest.mark.slow,)
                yield pytest.param(*row, id="-".join(row), marks=marks)


def _train(path, processes: int) -> None:
    if processes == 1:
        from yamlformer.recipes.training.run import run

        run(path, samples=False)
        return
    from sharded_helpers import train

    train(path)


def _losses(run_dir) -> dict:
    from sharded_helpers import losses

    return losses(run_dir)


@pytest.mark.parametrize("kind,strategy,task", list(_rows()))
def test_precision_strategy_task_matrix(tmp_path, capsys, kind, strategy, task):
    from yamlformer.builder.cli import main

    settings, processes = STRATEGIES[strategy]
    unbroken = tmp_path / "unbroken"
    _train(task_recipe(task, unbroken, kind, 6, **settings), processes)
    broken = tmp_path / "broken"
    _train(task_recipe(task, broken, kind, 4, **settings), processes)
    _train(task_recipe(task, broken, kind, 6, **settings), processes)  # resumes from step 4's checkpoint

    whole, resumed = _losses(unbroken / "run"), _losses(broken / "run")
    assert [s for s, _ in resumed["train"]] == list(range(1, 7)), resumed["train"]
    assert all(math.isfinite(v) for _, v in resumed["train"]), resumed["train"]
    from sharded_helpers import assert_same_losses

    assert_same_losses(whole, resumed, atol=2e-5, keys=("train",))  # the resume continued the losses

    checkpoint = broken / "run" / "checkpoints" / "last.ckpt"
    evaluate, generate = eval_and_generate_args(task, broken, checkpoint)
    capsys.readouterr()
    assert main(evaluate) == 0
    scored = json.loads(capsys.readouterr().out)
    assert all(math.isfinite(v) for v in scored.values() if isinstance(v, float)), scored
    if generate is not None:
        assert main(generate) == 0
        assert capsys.readouterr().out.strip()


def test_a_resumed_fp16_run_keeps_its_loss_scale(tmp_path, monkeypatch):
    """The scaler's state rides in the checkpoint: a resumed 16-mixed run goes on from its scale."""
    from yamlformer.recipes.training import run as train

    def growing(kind, device, sharded=False):  # from 1, the scale doubles every step (far from an overflow)
        scaler = torch.amp.GradScaler(device, init_scale=1.0, growth_interval=1)
        return precision.ClippingMixedPrecision(kind, device, scaler=scaler)

    monkeypatch.setattr(train, "lightning_plugin", growing)
    scales = {}
    for steps in (4, 6):
        _train(task_recipe("lm", tmp_path, "16-mixed", steps), 1)
        saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
        scales[steps] = saved["ClippingMixedPrecision"]["scale"]
    assert scales == {4: 2.0**4, 6: 2.0**6}  # not 2**2: the resumed run did not start over at 1
