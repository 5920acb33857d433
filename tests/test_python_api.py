"""The Python API against what a user may pass it: ``load_spec``, ``build_model``, ``estimate``,
a model's forward and ``generate``. A natural argument (a mapping, a path) is supported; anything
else is a ``TypeError`` or ``ValueError`` whose message names the argument and says what to pass,
never an internal ``IndexError``/``AttributeError`` or a silent success.

The forward's own checks add no host-device synchronisation: a dense model runs forward and
backward on the ``meta`` device, where reading any value back raises (and on a GPU, where one is
present, under ``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from yamlformer.builder import Layout, SpecError, Step, build_model, estimate, load_spec

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specs" / "tiny"
#: a decoder with RoPE (positions computed, no table to run past): max_seq_len is its only limit
ROPE = {
    "name": "api-rope",
    "architecture": "decoder-only",
    "vocab_size": 50,
    "d_model": 32,
    "max_seq_len": 16,
    "position": {"type": "rope"},
    "decoder": {
        "n_layers": 1,
        "attention": {"n_heads": 2},
        "ffn": {"type": "glu", "hidden_dim": 48},
        "norm": {"type": "rmsnorm"},
    },
}


@pytest.fixture(scope="module")
def rope_model():
    torch.manual_seed(0)
    return build_model(ROPE).eval()


def ids(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# -- load_spec -------------------------------------------------------------------------------------


def test_load_spec_takes_a_mapping():
    spec = load_spec(ROPE)
    assert spec.name == "api-rope" and spec.decoder.n_layers == 1 and spec.max_seq_len == 16
    assert load_spec(ROPE, overrides={"decoder.n_layers": 3}).decoder.n_layers == 3


def test_load_spec_of_a_mapping_equals_the_file(monkeypatch):
    """A file's mapping (as yaml.safe_load gives it) loads to the same spec; its extends: is read
    relative to the working folder, as any path given in Python is."""
    path = TINY / "gpt2.yaml"
    monkeypatch.chdir(path.parent)
    assert load_spec(yaml.safe_load(path.read_text())) == load_spec(path)


def test_load_spec_leaves_the_mapping_as_it_was():
    data = copy.deepcopy(ROPE)
    load_spec(data, overrides={"decoder.attention.n_heads": 4})
    assert data == ROPE


def test_a_validated_spec_round_trips_through_its_dump():
    spec = load_spec(TINY / "t5.yaml")
    assert "extends" not in spec.model_dump()  # resolved when the file was read
    assert load_spec(spec.model_dump()) == spec
    assert load_spec(spec) is spec
    assert load_spec(spec, overrides={"decoder.n_layers": 1}).decoder.n_layers == 1


def test_load_spec_takes_str_and_path_alike():
    assert load_spec(str(TINY / "llama.yaml")) == load_spec(TINY / "llama.yaml")


@pytest.mark.parametrize(
    "data, field, message",
    [
        ({**ROPE, "bogus": 1}, "bogus", "unknown key"),
        ({**ROPE, "d_model": "32"}, "d_model", "expected an integer"),
        ({**ROPE, "d_model": 32.0}, "d_model", "expected an integer"),
        ({**ROPE, "d_model": True}, "d_model", "expected an integer"),
        ({**ROPE, "max_seq_len": float("nan")}, "max_seq_len", "expected an integer"),
        ({**ROPE, "decoder": [1, 2]}, "decoder", "mapping"),
        ({**ROPE, 3: 1}, "3", "string"),
        ({**ROPE, "extends": 3}, "extends", "path"),
    ],
)
def test_a_bad_mapping_is_a_located_spec_error(data, field, message):
    with pytest.raises(SpecError) as caught:
        load_spec(data)
    text = str(caught.value)
    assert text.startswith("<mapping>") and field in text and message in text, text


def test_a_mapping_extending_a_missing_file_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match="nope.yaml: no such file"):
        load_spec({**ROPE, "extends": "nope.yaml"})


@pytest.mark.parametrize(
    "value, needle",
    [
        (None, "got NoneType"),
        (3, "got int"),
        (b"spec.yaml", "got bytes"),
        (["spec.yaml"], "got list"),
        ("architecture: decoder-only\nd_model: 32\n", "not YAML text"),
    ],
)
def test_load_spec_says_what_to_pass(value, needle):
    with pytest.raises(TypeError) as caught:
        load_spec(value)
    assert needle in str(caught.value) and "load_spec" in str(caught.value)


def test_load_spec_arguments():
    with pytest.raises(TypeError, match="overrides takes a mapping of dotted keys"):
        load_spec(ROPE, overrides=[("decoder.n_layers", 2)])
    with pytest.raises(SpecError, match="an override's key is a dotted field path"):
        load_spec(ROPE, overrides={3: 1})
    with pytest.raises(SpecError, match="decoder.n_layers: expected an integer"):
        load_spec(ROPE, overrides={"decoder.n_layers": "2"})
    with pytest.raises(TypeError, match="plugins takes a list of module names"):
        load_spec(ROPE, plugins="tests.plugin_blocks")


# -- build_model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [str(TINY / "llama.yaml"), TINY / "llama.yaml", "mapping"])
def test_build_model_takes_a_path_or_a_mapping(given, monkeypatch):
    if given == "mapping":
        monkeypatch.chdir(TINY)
        given = yaml.safe_load((TINY / "llama.yaml").read_text())
    model = build_model(given, device="meta")
    assert model.spec == load_spec(TINY / "llama.yaml")
    assert model.n_params() == build_model(load_spec(TINY / "llama.yaml"), device="meta").n_params()


def test_build_model_takes_a_dtype_by_name():
    model = build_model(ROPE, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"device": "bogus"}, ValueError, "device must be 'cpu', 'cuda'"),
        ({"device": 5}, ValueError, "device must be"),
        ({"dtype": "int8"}, ValueError, "dtype must be a floating torch.dtype or one of"),
        ({"dtype": torch.int64}, TypeError, "dtype must be a floating torch.dtype"),
        ({"dtype": 16}, TypeError, "dtype must be a floating torch.dtype"),
        ({"attention_backend": "flash"}, ValueError, "attention_backend must be one of auto, eager, sdpa, triton"),
    ],
)
def test_build_model_arguments(kwargs, error, needle):
    with pytest.raises(error) as caught:
        build_model(ROPE, **kwargs)
    assert needle in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_build_model_on_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available here"):
        build_model(ROPE, device="cuda")


def test_build_model_of_nothing_says_what_to_pass():
    with pytest.raises(TypeError, match="a path to a spec file .* a mapping of spec fields or a ModelSpec"):
        build_model(None)


# -- a model's forward -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [50, 1000, -1])
def test_token_ids_outside_the_vocabulary(rope_model, bad):
    with pytest.raises(ValueError, match=r"input_ids holds ids outside the vocabulary .*\[0, 49\]"):
        rope_model(ids([1, bad, 2]))


def test_segment_ids_outside_the_table():
    model = build_model(TINY / "bert.yaml")
    tokens = ids([1, 2, 3])
    model(tokens, token_type_ids=ids([0, 1, 1]))
    with pytest.raises(ValueError, match=r"token_type_ids holds ids outside the segment table .*\[0, 1\]"):
        model(tokens, token_type_ids=ids([0, 2, 1]))


@pytest.mark.parametrize(
    "value, error, needle",
    [
        ([[1, 2]], TypeError, "input_ids must be a torch.Tensor"),
        (torch.tensor([[1.0, 2.0]]), ValueError, "integer token ids"),
        (torch.tensor([1, 2]), ValueError, "input_ids must be (batch, seq)"),
    ],
)
def test_input_ids_of_the_wrong_kind(rope_model, value, error, needle):
    with pytest.raises(error) as caught:
        rope_model(value)
    assert needle in str(caught.value)


def test_input_ids_on_another_device(rope_model):
    with pytest.raises(ValueError, match=r"input_ids are on meta, the model on cpu; move them first"):
        rope_model(torch.zeros(1, 3, dtype=torch.long, device="meta"))


def test_a_forward_beyond_max_seq_len_with_rope(rope_model):
    rope_model(torch.zeros(1, 16, dtype=torch.long))  # the whole context is fine
    with pytest.raises(ValueError, match="17 positions .* exceed the model's max_seq_len 16"):
        rope_model(torch.zeros(1, 17, dtype=torch.long))


def test_a_bad_attention_mask(rope_model):
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        rope_model(ids([1, 2, 3]), attention_mask=[[1, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\)"):
        rope_model(ids([1, 2, 3]), attention_mask=torch.ones(1, 2, dtype=torch.long))


# -- generate --------------------------------------------------------------------------------------


def test_generate_with_an_empty_prompt(rope_model):
    with pytest.raises(ValueError, match="input_ids is empty.*: pass at least one token per row"):
        rope_model.generate(torch.zeros(1, 0, dtype=torch.long), 4)


def test_generate_up_to_max_seq_len_and_not_beyond(rope_model):
    """With RoPE nothing else stops a decode at max_seq_len: the call is refused before any work,
    saying how many tokens fit; exactly that many are generated."""
    prompt = ids([1, 2, 3])
    out = rope_model.generate(prompt, 14)  # 3 + 14 - 1 = 16 positions fed
    assert out.shape == (1, 17)
    for kwargs in ({}, {"num_beams": 2}, {"temperature": 1.0}):
        with pytest.raises(
            ValueError, match="need 17 positions, more than the model's max_seq_len 16; ask for at most 14 new tokens"
        ):
            rope_model.generate(prompt, 15, **kwargs)
    with pytest.raises(ValueError, match="a prompt of at most 16 tokens"):
        rope_model.generate(torch.zeros(1, 17, dtype=torch.long), 1)


def test_generate_with_ids_outside_the_vocabulary(rope_model):
    with pytest.raises(ValueError, match=r"input_ids holds ids outside the vocabulary: ids must be in \[0, 49\]"):
        rope_model.generate(ids([1, 50]), 2)
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id in \[0, 49\], got 99"):
        rope_model.generate(ids([1, 2]), 2, eos_token_id=99)
    with pytest.raises(ValueError, match=r"pad_token_id must be a token id"):
        rope_model.generate(ids([1, 2]), 2, pad_token_id=-1)


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an int"),
        ({"max_new_tokens": None}, TypeError, "max_new_tokens must be an int"),
        ({"num_beams": 0}, ValueError, "num_beams must be >= 1"),
        ({"num_beams": True}, TypeError, "num_beams must be an int"),
        ({"top_k": 0}, ValueError, "top_k must be >= 1"),
        ({"top_p": 2.0}, ValueError, "top_p must be in (0, 1]"),
        ({"temperature": math.nan}, ValueError, "temperature must be a finite number"),
        ({"temperature": math.inf}, ValueError, "temperature must be a finite number"),
        ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
        ({"length_penalty": math.nan, "num_beams": 2}, ValueError, "length_penalty must be a finite number"),
        ({"streamer": 3}, TypeError, "streamer must be a callable"),
        ({"generator": 3, "temperature": 1.0}, TypeError, "generator must be a torch.Generator"),
        ({"attention_mask": [[1, 1]]}, TypeError, "attention_mask must be a torch.Tensor"),
    ],
)
def test_generate_arguments(rope_model, kwargs, error, needle):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error) as caught:
        rope_model.generate(ids([1, 2]), **kwargs)
    assert needle in str(caught.value)


def test_generate_a_prompt_that_is_not_a_tensor(rope_model):
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor of token ids"):
        rope_model.generate([[1, 2]], 2)


def test_an_encoder_only_model_does_not_generate():
    model = build_model(TINY / "bert.yaml")
    with pytest.raises(TypeError, match="EncoderOnlyModel has no causal decoder to generate with"):
        model.generate(ids([1, 2]), 2)


def test_an_encoder_decoder_generates_within_max_seq_len():
    model = build_model(TINY / "t5.yaml").eval()  # max_seq_len 64, relative position bias
    source = torch.ones(1, 5, dtype=torch.long)
    assert model.generate(source, 64, decoder_start_token_id=0).shape == (1, 65)  # the start token + 64
    with pytest.raises(ValueError, match="ask for at most 64 new tokens"):
        model.generate(source, 65, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="input_ids has 65 tokens, more than the model's max_seq_len 64"):
        model.generate(torch.ones(1, 65, dtype=torch.long), 2, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="decoder_start_token_id must be a token id"):
        model.generate(source, 2, decoder_start_token_id=256)


# -- estimate --------------------------------------------------------------------------------------


def test_estimate_takes_a_path_or_a_mapping():
    spec = load_spec(ROPE)
    assert estimate(ROPE, seq_len=8) == estimate(spec, seq_len=8)
    assert estimate(TINY / "llama.yaml").params.total == estimate(load_spec(TINY / "llama.yaml")).params.total


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"seq_len": 17}, "seq_len 17 is more than api-rope's max_seq_len 16"),
        ({"seq_len": 0}, "seq_len must be a positive int, got 0"),
        ({"seq_len": True}, "seq_len must be a positive int, got True"),
        ({"seq_len": 8.0}, "seq_len must be a positive int, got 8.0"),
        ({"batch": -1}, "batch must be a positive int"),
        ({"dtype": "int8"}, "dtype must be one of fp32, bf16, fp16"),
        ({"src_len": 8}, "src_len applies to encoder-decoder models"),
        ({"layout": {"nodes": 0}}, "nodes=0: must be a positive integer"),
        ({"layout": {"devices": True}}, "devices=True: must be a positive integer"),
        ({"layout": {"strategy": "zero3"}}, "strategy='zero3': must be one of ddp, fsdp"),
        ({"layout": {"strategy": "ddp", "data_parallel": "hybrid"}}, "data_parallel='hybrid': needs strategy fsdp"),
        ({"layout": {"strategy": "ddp", "tensor_parallel": 2}}, "tensor_parallel=2: needs strategy fsdp"),
    ],
)
def test_estimate_arguments(kwargs, needle):
    with pytest.raises(ValueError) as caught:
        if "layout" in kwargs:
            estimate(ROPE, layout=Layout(**kwargs["layout"]))
        else:
            estimate(ROPE, **kwargs)
    assert needle in str(caught.value)


def test_estimate_takes_a_step_and_a_layout():
    assert estimate(ROPE, Step(seq_len=8, batch=2)) == estimate(ROPE, seq_len=8, batch=2)
    sharded = estimate(ROPE, Step(seq_len=8), Layout(devices=2))
    assert sharded.settings["strategy"] == "fsdp" and sharded.settings["devices"] == 2
    with pytest.raises(TypeError, match="the devices are a Layout"):
        estimate(ROPE, devices=2)
    with pytest.raises(TypeError, match="not both"):
        estimate(ROPE, Step(seq_len=8), batch=2)


def test_estimate_src_len_beyond_max_seq_len():
    with pytest.raises(ValueError, match="src_len 65 is more than tiny-t5's max_seq_len 64"):
        estimate(TINY / "t5.yaml", seq_len=8, src_len=65)


def test_estimate_of_nothing_says_what_to_pass():
    with pytest.raises(TypeError, match="a path to a spec file"):
        estimate(None)


# -- no host-device synchronisation in a training forward -----------------------------------------

#: dense models (MoE routing counts tokens per expert on the host by design)
DENSE = ["gpt2", "llama", "gemma2", "alibi", "bert", "t5", "transformer"]


def _train_step(model, device) -> None:
    tokens = torch.zeros(2, 16, dtype=torch.long, device=device)
    if model.spec.architecture == "encoder-decoder":
        out = model(tokens, decoder_input_ids=tokens, attention_mask=torch.ones_like(tokens))
    else:
        out = model(tokens, attention_mask=torch.ones_like(tokens))
    out.float().sum().backward()


@pytest.mark.parametrize("name", DENSE)
def test_a_training_forward_reads_nothing_back_from_the_device(name):
    """On ``meta`` every ``.item()``, ``bool(tensor)`` or copy to the host raises: the input checks
    of the forward (ids, lengths, masks, positions) are free on an accelerator."""
    model = build_model(TINY / f"{name}.yaml", device="meta", attention_backend="sdpa")
    _train_step(model, "meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_a_training_forward_does_not_synchronise_a_gpu(name):
    model = build_model(TINY / f"{name}.yaml", device="cuda", attention_backend="sdpa")
    _train_step(model, "cuda")  # warm-up: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _train_step(model, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
