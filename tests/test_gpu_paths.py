"""What the first GPU run found, held on the CPU: the choices behind each fix are tested here with
the device detection patched, so the suite means the same with or without a GPU."""

from __future__ import annotations

import importlib
import logging
import os

import lightning as L
import pytest
import torch
from recipe_helpers import tiny_recipe

from yamlformer.kernels import Mask

attn = importlib.import_module("yamlformer.kernels.attention")  # the module (the package exports its function)

# -- attention: what `auto` runs -------------------------------------------------------------------

#: each option auto_backend weighs besides causal, by its name in a case key
MASKS = list(Mask.OPTIONS)


def _qv(seq_q=16, head_dim=64):
    return torch.empty(1, 4, seq_q, head_dim), torch.empty(1, 2, 16, head_dim)


@pytest.mark.parametrize("causal", [True, False])
def test_auto_takes_sdpa_on_cuda_wherever_sdpa_needs_no_mask(causal):
    q, v = _qv()
    assert attn.auto_backend("cuda", q, v, Mask(causal=causal), 0.0) == "sdpa"
    q1, _ = _qv(seq_q=1)  # a decode step: one query sees every key
    assert attn.auto_backend("cuda", q1, v, Mask(causal=causal), 0.0) == "sdpa"


@pytest.mark.parametrize("mask", list(MASKS))
def test_auto_takes_triton_on_cuda_where_only_a_mask_tensor_would_tell_sdpa(mask):
    q, v = _qv()
    masked = Mask(causal=True, **{Mask.OPTIONS[mask]: object()})  # only its presence is read
    assert attn.auto_backend("cuda", q, v, masked, 0.0) == "triton"
    assert attn.auto_backend("cpu", q, v, masked, 0.0) == "sdpa"
    assert attn.auto_backend("cuda", q, v, masked, 0.1) == "sdpa"  # dropout: ours has none
    wide_q, wide_v = _qv(head_dim=288)
    assert attn.auto_backend("cuda", wide_q, wide_v, masked, 0.0) == "sdpa"  # over the Triton tiles
    short_q, _ = _qv(seq_q=8)  # causal over fewer queries than keys: SDPA would need a mask
    assert attn.auto_backend("cuda", short_q, v, Mask(causal=True), 0.0) == "triton"


@pytest.mark.parametrize("window", [None, 5])
def test_auto_runs_the_backend_it_chose_with_cuda_detection_patched(monkeypatch, window):
    """The wiring: `attention(backend="auto")` asks auto_backend as if on a GPU and runs what it
    says (the Triton kernel under the interpreter for a window, SDPA without), to eager's numbers."""
    from yamlformer.kernels import triton_attention

    chosen = []
    real = attn.auto_backend
    monkeypatch.setattr(attn, "auto_backend", lambda _, *args: chosen.append(real("cuda", *args)) or chosen[-1])
    called = []
    kernel = triton_attention.flash_attention
    monkeypatch.setattr(triton_attention, "flash_attention", lambda *a: called.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 20, 16, generator=g) for h in (4, 2, 2))
    out = attn.attention(q, k, v, Mask(causal=True, sliding_window=window), backend="auto")
    expected = attn.attention(q, k, v, Mask(causal=True, sliding_window=window), backend="eager")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert chosen == ["sdpa" if window is None else "triton"]
    assert bool(called) == (window is not None)


# -- validation under a sharded strategy -----------------------------------------------------------


class _Watch(L.Callback):
    """Records whether validation ran under inference mode and whether it left inference tensors
    in the parameters, then saves the model's state dict as the next checkpoint would."""

    def __init__(self):
        self.seen = []

    def on_validation_batch_start(self, trainer, pl_module, *args):
        self.seen.append(("inference mode", torch.is_inference_mode_enabled()))

    def on_validation_end(self, trainer, pl_module):
        local = [getattr(p, "_local_tensor", p) for p in pl_module.parameters()]
        self.seen.append(("inference parameters", any(t.is_inference() for t in local)))
        self.seen.append(("state dict", len(trainer.strategy.lightning_module_state_dict())))


def test_a_sharded_runs_validation_leaves_parameters_a_checkpoint_can_save(tmp_path, monkeypatch):
    """FSDP2 unshards into inference tensors under Lightning's default inference_mode, and the
    next save's `param.detach()` then fails (every sharded CUDA run died at its end): validation
    runs under no_grad, its parameters stay ordinary tensors, and the state dict is taken.
    Lightning itself validates under no_grad on gloo, which hid this on the CPU: its check is
    patched to see the NCCL a GPU run has."""
    from lightning.pytorch.loops import utilities

    from yamlformer.recipes.training.run import run

    monkeypatch.setattr(utilities, "_distributed_is_initialized", lambda: False)
    monkeypatch.delenv("MASTER_PORT", raising=False)

    watch = _Watch()
    # a run that does not end on a validation: its end validates again (trainer.validate, which
    # the crash came from; fit's own validations run under no_grad whatever the Trainer says)
    trainer = {"strategy": "fsdp", "max_steps": 3, "val_check_interval": 2, "checkpoint_every_n_steps": 2}
    summary = run(tiny_recipe(tmp_path, trainer=trainer), samples=False, callbacks=[watch])
    assert summary["steps"] == 3 and summary["val_loss"] is not None
    assert sum(kind == "state dict" for kind, _ in watch.seen) == 2  # fit's validation and the end's
    kinds = {kind for kind, _ in watch.seen}
    assert kinds == {"inference mode", "inference parameters", "state dict"}
    assert all(value is False for kind, value in watch.seen if kind != "state dict")
    assert all(value > 0 for kind, value in watch.seen if kind == "state dict")
    # and the run leaves no process group, and no port, to the next run in this process (the next
    # `builder train` the suite started inherited MASTER_PORT and found it taken: EADDRINUSE)
    import torch.distributed as dist

    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ


# -- float32 matmuls ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "setting", "expected"),
    [
        ("bf16-mixed", "auto", "high"),
        ("32", "auto", "highest"),
        ("32", "high", "high"),
        ("bf16-true", "medium", "medium"),
    ],
)
def test_the_recipe_sets_float32_matmuls_and_lightnings_advice_is_not_printed(
    tmp_path, monkeypatch, caplog, precision, setting, expected
):
    from lightning.fabric.accelerators import cuda as lightning_cuda

    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import make_trainer, quiet_lightning

    before = torch.get_float32_matmul_precision()
    try:
        path = tiny_recipe(tmp_path, trainer={"precision": precision, "matmul_precision": setting})
        make_trainer(load_recipe(path).recipe, tmp_path / "out", [])
        assert torch.get_float32_matmul_precision() == expected
        # what Lightning's CUDA accelerator runs at setup, as on an Ampere or later GPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(lightning_cuda, "_is_ampere_or_later", lambda device=None: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
        quiet_lightning()
        with caplog.at_level(logging.INFO):
            lightning_cuda._check_cuda_matmul_precision(torch.device("cuda", 0))
        assert "set_float32_matmul_precision" not in caplog.text
    finally:
        torch.set_float32_matmul_precision(before)


# -- host synchronisations per training step ---------------------------------------------------------

#: the Tensor methods that read a value back to the host (on a GPU each waits for every queued kernel)
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.nonzero,
    torch.Tensor.nonzero,
}


class _HostReads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _CountReads(L.Callback):
    """Host reads from the start of each training batch to the start of the next (its forward,
    backward, clipping, optimizer step, schedule and every batch-end hook), by step."""

    def __init__(self):
        self.by_step: dict[int, list[str]] = {}
        self._mode, self._step = None, None

    def _close(self):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.by_step[self._step] = self._mode.calls
            self._mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        self._mode, self._step = _HostReads(), trainer.global_step + 1
        self._mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        self._close()


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_a_training_step_reads_nothing_back_to_the_host_but_at_log_steps(tmp_path, precision):
    """What a step costs beyond the model: no value read back (a GPU sync) in a step that neither
    logs nor saves; the losses are read once per log interval."""
    from yamlformer.recipes.training.run import run

    counter = _CountReads()
    trainer = {
        "max_steps": 8,
        "log_every_n_steps": 4,
        "val_check_interval": 100,
        "checkpoint_every_n_steps": 100,
        "precision": precision,
    }
    run(tiny_recipe(tmp_path, trainer=trainer), samples=False, callbacks=[counter])
    assert sorted(counter.by_step) == list(range(1, 9))
    quiet = {step: calls for step, calls in counter.by_step.items() if step % 4}
    assert quiet == {step: [] for step in quiet}, quiet
    assert all(counter.by_step[step] for step in (4, 8))  # the loss, read at each log step


def test_a_cuda_runs_batches_come_in_pinned_memory():
    """Lightning copies each batch to the GPU non-blocking; from pageable memory that copy is
    staged by the host first. Every task's loader pins its batches when the run is on CUDA."""
    from types import SimpleNamespace

    from yamlformer.recipes.data.windows import loader

    on = lambda kind: SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(kind, 0)))
    assert loader([], on("cuda")).pin_memory
    assert not loader([], on("cpu")).pin_memory and not loader([], None).pin_memory


def test_each_micro_batch_seeds_the_cpu_generator_and_its_gpus_only(monkeypatch):
    """Dropout's draws per micro-batch come from the CPU's generator and the step's GPU's; the
    other GPUs' (and device kinds never used) are left alone. torch.manual_seed, which seeds
    them all, recorded a stack trace per step for each device kind not yet initialised."""
    from yamlformer.recipes.learning.module import seed_generators

    fakes = (torch.Generator(), torch.Generator())
    for g in fakes:
        g.manual_seed(99)
    monkeypatch.setattr(torch.cuda, "default_generators", fakes)
    before = torch.default_generator.get_state()
    try:
        seed_generators(torch.device("cuda", 1), 1234)
        assert torch.default_generator.initial_seed() == 1234
        assert [g.initial_seed() for g in fakes] == [99, 1234]
    finally:
        torch.default_generator.set_state(before)
