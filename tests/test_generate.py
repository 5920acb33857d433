"""KV-cached decoding: cached equals full recomputation for every tiny spec (windows past the
window, ALiBi, T5 bias), the cache's bytes follow the documented formula, greedy, sampling,
beam search, EOS, padding and streaming behave as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from yamlformer.builder import build_model, load_spec
from yamlformer.builder.spec.schema import spec_model

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

ROOT = Path(__file__).resolve().parents[1]
TINY = sorted(p for p in (ROOT / "specs").rglob("*.yaml") if "tiny" in str(p.relative_to(ROOT)))
GENERATIVE = [p for p in TINY if load_spec(p).architecture != "encoder-only"]


def _ids(p: Path) -> str:
    return p.stem


def _model(spec, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return build_model(spec, **kwargs).eval()


def _window_spec(position: dict, window: int = 5, **extra) -> object:
    """A tiny decoder whose every layer has a sliding window (short, to decode far past it)."""
    data = {
        "name": "tiny-window",
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 64,
        "position": position,
        "decoder": {
            "n_layers": 2,
            "attention": {"n_heads": 4, "n_kv_heads": 2, "sliding_window": window},
            "ffn": {"type": "glu", "hidden_dim": 48},
            "norm": {"type": "rmsnorm"},
        },
    }
    data.update(extra)
    return spec_model().model_validate(data)


WINDOW_SPECS = {
    "rope": _window_spec({"type": "rope"}),
    "alibi": _window_spec({"type": "alibi"}),
    "learned": _window_spec({"type": "learned"}),
    "none": _window_spec({"type": "none"}),
}


def _inputs(spec, batch: int = 2, prompt: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, spec.vocab_size, (batch, prompt), generator=g)
    if spec.architecture == "encoder-decoder":
        return src, {"decoder_input_ids": torch.randint(0, spec.vocab_size, (batch, 2), generator=g)}
    return src, {}


@pytest.mark.parametrize("path", GENERATIVE, ids=_ids)
def test_cached_greedy_equals_full_recomputation(path):
    spec = load_spec(path)
    model = _model(spec)
    x, kw = _inputs(spec)
    new = 24 if spec.architecture == "encoder-decoder" else 30  # past gemma2's 16-token window
    cached = model.generate(x, max_new_tokens=new, **kw)
    full = model.generate(x, max_new_tokens=new, use_cache=False, **kw)
    assert torch.equal(cached, full)
    assert cached.shape == (2, (kw["decoder_input_ids"].shape[1] if kw else x.shape[1]) + new)


@pytest.mark.parametrize("path", GENERATIVE, ids=_ids)
def test_cached_logits_equal_full_forward(path):
    """Feed a sequence token by token through the cache; every step's logits match the full pass."""
    from yamlformer.blocks.generation import KVCache

    spec = load_spec(path)
    model = _model(spec)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, spec.vocab_size, (2, 20), generator=g)
    src = torch.randint(0, spec.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        if spec.architecture == "encoder-decoder":
            memory = model.encode(src)
            full = model(src, decoder_input_ids=seq)
            step = lambda ids, cache: model(None, decoder_input_ids=ids, memory=memory, cache=cache)
        else:
            full = model(seq)
            step = lambda ids, cache: model(ids, cache=cache)
        cache = KVCache.for_stack(model.decoder, 2, 20, torch.float32, "cpu")
        parts = [step(seq[:, :6], cache)]  # a prefill of 6, then one token at a time
        parts += [step(seq[:, i : i + 1], cache) for i in range(6, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(WINDOW_SPECS))
def test_sliding_window_cache_evicts_and_stays_exact(name):
    spec = WINDOW_SPECS[name]
    model = _model(spec)
    x, _ = _inputs(spec, prompt=8)  # a prompt longer than the window, then 3 windows more
    cached = model.generate(x, max_new_tokens=16)
    # the ring buffer holds the window, not the sequence: layers * (k, v) * batch * kv heads * window * head_dim * fp32
    assert model.last_cache_nbytes == 2 * 2 * 2 * 2 * 5 * 8 * 4
    full = model.generate(x, max_new_tokens=16, use_cache=False)
    assert torch.equal(cached, full)


def test_window_cache_with_chunked_prefill_matches_full():
    """Chunks of several tokens meeting a wrapped ring buffer (the general update path)."""
    from yamlformer.blocks.generation import KVCache

    spec = WINDOW_SPECS["alibi"]
    model = _model(spec)
    seq = torch.randint(0, spec.vocab_size, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(seq)
        cache = KVCache.for_stack(model.decoder, 2, 23, torch.float32, "cpu")
        parts = [model(seq[:, a:b], cache=cache) for a, b in ((0, 7), (7, 10), (10, 11), (11, 19), (19, 23))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


def _expected_cache_bytes(model, spec, rows: int, prompt: int, new: int, src: int | None) -> int:
    """The documented policy, from the spec alone."""
    total = 0
    stack = spec.decoder
    for i in range(stack.n_layers):
        layer = stack.layer(i)
        attn = layer.attention
        # what the block declares it caches per token (multi_head: keys and values of every
        # key/value head; mla: the latent and the one rotary key) and how far back
        layout = attn.kv_cache(spec.d_model)
        per_token, window = sum(t.heads * t.width for t in layout.tensors), layout.window
        capacity = prompt + new if window is None else min(prompt + new, window)
        total += rows * capacity * per_token * 4
        if src is not None:
            cross = layer.cross_attention.kv_cache(spec.d_model, cross=True)  # the source's keys and values
            total += rows * src * sum(t.heads * t.width for t in cross.tensors) * 4
    return total


@pytest.mark.parametrize("path", GENERATIVE, ids=_ids)
def test_cache_bytes_follow_the_documented_formula(path):
    spec = load_spec(path)
    model = _model(spec)
    x, kw = _inputs(spec, prompt=6)
    prompt = kw["decoder_input_ids"].shape[1] if kw else 6
    src = 6 if kw else None
    model.generate(x, max_new_tokens=20, **kw)
    assert model.last_cache_nbytes == _expected_cache_bytes(model, spec, 2, prompt, 20, src)
    model.generate(x, max_new_tokens=4, num_beams=3, **kw)
    assert model.last_cache_nbytes == _expected_cache_bytes(model, spec, 6, prompt, 4, src)


@pytest.mark.parametrize("path", GENERATIVE, ids=_ids)
def test_beam_search_with_one_beam_is_greedy(path):
    spec = load_spec(path)
    model = _model(spec)
    x, kw = _inputs(spec)
    greedy = model.generate(x, max_new_tokens=8, **kw)
    assert torch.equal(model.generate(x, max_new_tokens=8, num_beams=1, **kw), greedy)
    # the beam-search code path itself, with one beam
    from yamlformer.blocks import generation

    state = model._decode_state(x, None, kw.get("decoder_input_ids"), None, None, 1, True, 8)
    beams = generation._beam_search(state, 1, 8, [], None, 1.0, False)
    assert torch.equal(beams, greedy)


def _sequence_logprob(model, spec, x, kw, out):
    prompt = kw["decoder_input_ids"].shape[1] if kw else x.shape[1]
    with torch.no_grad():
        logits = model(x, decoder_input_ids=out) if kw else model(out)
    logp = torch.log_softmax(logits.float(), -1)[:, prompt - 1 : -1]
    return logp.gather(-1, out[:, prompt:, None]).squeeze(-1).sum(-1)


@pytest.mark.parametrize("path", [p for p in GENERATIVE if p.stem in ("llama", "t5")], ids=_ids)
def test_beam_search_matches_exhaustive_search(path):
    """With as many beams as sequences, beam search must return the most likely sequence."""
    spec = load_spec(path)
    data = spec.model_dump(exclude={"extends"})
    data["vocab_size"] = 6
    spec = spec_model().model_validate(data)
    model = _model(spec)
    x, kw = _inputs(spec, batch=1, prompt=3)
    out = model.generate(x, max_new_tokens=3, num_beams=36, length_penalty=0.0, **kw)
    prompt = out.shape[1] - 3
    every = torch.cartesian_prod(*[torch.arange(6)] * 3)  # (216, 3)
    candidates = torch.cat((out[:, :prompt].expand(len(every), -1), every), dim=1)
    kw_all = {"decoder_input_ids": kw["decoder_input_ids"].expand(len(every), -1)} if kw else {}
    scores = _sequence_logprob(model, spec, x.expand(len(every), -1), kw_all, candidates)
    assert torch.equal(out[0], candidates[scores.argmax()])


def test_beam_search_eos_and_length_penalty():
    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml")
    model = _model(spec)
    x, _ = _inputs(spec, batch=2)
    greedy = model.generate(x, max_new_tokens=6)
    eos = int(greedy[0, 6])  # the second new token of row 0 becomes EOS
    out = model.generate(x, max_new_tokens=6, num_beams=4, eos_token_id=eos, pad_token_id=255)
    assert out.shape[0] == 2 and out.shape[1] <= 11
    for row in out:
        new = row[5:]
        if (new == eos).any():
            after = new[int((new == eos).nonzero()[0]) + 1 :]
            assert (after == 255).all()
    # encoder-decoder beam search with EOS runs and pads
    t5 = load_spec(ROOT / "specs" / "tiny" / "t5.yaml")
    m5 = _model(t5)
    src, kw = _inputs(t5)
    out5 = m5.generate(src, max_new_tokens=5, num_beams=3, eos_token_id=1, pad_token_id=0, **kw)
    assert out5.shape[0] == 2 and out5.shape[1] <= 7


@pytest.mark.parametrize("path", [p for p in GENERATIVE if p.stem in ("llama", "alibi", "gpt2", "gemma2")], ids=_ids)
def test_left_padded_batch_matches_each_sequence_alone(path):
    spec = load_spec(path)
    model = _model(spec)
    g = torch.Generator().manual_seed(7)
    short = torch.randint(0, spec.vocab_size, (1, 4), generator=g)
    long = torch.randint(0, spec.vocab_size, (1, 7), generator=g)
    batch = torch.cat((torch.cat((torch.zeros(1, 3, dtype=torch.long), short), 1), long))
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = model.generate(batch, max_new_tokens=6, attention_mask=mask)
    assert torch.equal(out[0, 3:], model.generate(short, max_new_tokens=6)[0])
    assert torch.equal(out[1], model.generate(long, max_new_tokens=6)[0])
    beams = model.generate(batch, max_new_tokens=4, attention_mask=mask, num_beams=2)
    assert torch.equal(beams[0, 3:], model.generate(short, max_new_tokens=4, num_beams=2)[0])


@pytest.mark.parametrize("name", ["t5", "transformer"])
def test_padded_source_batch_matches_each_source_alone(name):
    spec = load_spec(ROOT / "specs" / "tiny" / f"{name}.yaml")
    model = _model(spec)
    g = torch.Generator().manual_seed(8)
    src = torch.randint(1, spec.vocab_size, (2, 6), generator=g)
    mask = torch.ones_like(src)
    mask[0, 4:] = 0  # right padding on the source side
    start = torch.zeros(2, 1, dtype=torch.long)
    out = model.generate(src, max_new_tokens=5, attention_mask=mask, decoder_input_ids=start)
    alone = model.generate(src[:1, :4], max_new_tokens=5, decoder_input_ids=start[:1])
    assert torch.equal(out[0], alone[0])


def test_sampling_semantics():
    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml")
    model = _model(spec)
    x, _ = _inputs(spec)
    greedy = model.generate(x, max_new_tokens=8)
    assert torch.equal(model.generate(x, max_new_tokens=8, top_k=1), greedy)  # top_k=1 is greedy
    assert torch.equal(model.generate(x, max_new_tokens=8, temperature=0), greedy)
    assert torch.equal(model.generate(x, max_new_tokens=8, top_p=1e-6), greedy)  # keeps the top token
    a = model.generate(x, max_new_tokens=8, temperature=5.0, generator=torch.Generator().manual_seed(1))
    b = model.generate(x, max_new_tokens=8, temperature=5.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, greedy)  # seeded, and it does sample


def test_sample_next_filters():
    from yamlformer.blocks.generation import sample_next

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).log_softmax(-1).expand(2000, 4)
    drawn = sample_next(logits, None, 2, None, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {2, 3}
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(2000, 4)
    drawn = sample_next(probs, None, None, 0.75, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75


def test_eos_stops_and_pads_and_streamer_sees_every_token():
    spec = load_spec(ROOT / "specs" / "tiny" / "gpt2.yaml")
    model = _model(spec)
    x, _ = _inputs(spec)
    greedy = model.generate(x, max_new_tokens=10)
    eos = int(greedy[0, 7])
    seen = []
    out = model.generate(x, max_new_tokens=10, eos_token_id=eos, pad_token_id=255, streamer=seen.append)
    row0 = out[0, 5:]
    stop = int((row0 == eos).nonzero()[0])
    assert (row0[stop + 1 :] == 255).all()
    assert torch.equal(torch.stack(seen, dim=1), out[:, 5:])

    class Streamer:  # Hugging Face's put/end protocol
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, t):
            self.tokens.append(t)

        def end(self):
            self.ended = True

    s = Streamer()
    model.generate(x, max_new_tokens=3, streamer=s)
    assert len(s.tokens) == 3 and s.ended


def test_generate_rejects_bad_arguments():
    spec = load_spec(ROOT / "specs" / "tiny" / "gpt2.yaml")
    model = _model(spec)
    x, _ = _inputs(spec)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(x, max_new_tokens=0)
    with pytest.raises(ValueError, match="beam search with sampling"):
        model.generate(x, max_new_tokens=2, num_beams=2, temperature=0.7)
    t5 = load_spec(ROOT / "specs" / "tiny" / "t5.yaml")
    with pytest.raises(ValueError, match="decoder_input_ids"):
        _model(t5).generate(x, max_new_tokens=2)


def test_generate_restores_training_mode_and_backends_agree():
    spec = load_spec(ROOT / "specs" / "tiny" / "gemma2.yaml")
    eager = _model(spec, attention_backend="eager").train()
    sdpa = _model(spec, attention_backend="sdpa")
    x, _ = _inputs(spec)
    assert torch.equal(eager.generate(x, max_new_tokens=20), sdpa.generate(x, max_new_tokens=20))
    assert eager.training


def test_each_sample_prompt_draws_its_own_random_numbers(capsys):
    """Two different prompts printed the same text after training: every prompt started from the
    run's seed, so a model whose next token barely depends on the prompt sampled the same tokens.
    Here the model's logits are uniform (all weights zero): the text is the draws alone."""
    import string

    from recipe_helpers import TINY_SPEC

    from yamlformer.recipes.data.tokenizers import CharTokenizer
    from yamlformer.recipes.recipe.sections import Recipe
    from yamlformer.recipes.tasks.lm.training import print_samples

    tokenizer = CharTokenizer(sorted(set(string.ascii_letters)))
    spec = spec_model().model_validate({**TINY_SPEC, "vocab_size": tokenizer.vocab_size})
    model = _model(spec)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    recipe = Recipe.model_validate(
        {
            "model": {"spec": TINY_SPEC},
            "sample": {"prompts": ["def", "class", "def"], "max_new_tokens": 12, "top_k": None},
        }
    )
    print_samples(model, tokenizer, recipe)
    texts = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith("---")]
    first, second, again = (text[len(prompt) :] for text, prompt in zip(texts, ["def", "class", "def"]))
    assert first != second  # other prompts, other draws
    assert first == again  # the same prompt, the same sample


def test_padding_rows_past_the_tokenizer_are_never_generated():
    """An embedding larger than its tokenizer (padding rows): with random weights the decoding
    loop of `builder generate` picked a padding row, and sentencepiece's decode raised on it."""
    import io

    import sentencepiece as spm
    from recipe_helpers import TINY_SPEC

    from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer
    from yamlformer.recipes.tasks.lm.streaming import stream

    buffer = io.BytesIO()
    text = ["the cat sat on the mat", "a dog ran in the park"] * 50
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=buffer, vocab_size=30, hard_vocab_limit=False, minloglevel=2
    )
    tokenizer = SentencePieceTokenizer(buffer.getvalue())
    size = tokenizer.vocab_size
    model = _model(spec_model().model_validate({**TINY_SPEC, "vocab_size": 4 * size}))
    x = torch.tensor([tokenizer.encode("the cat")])
    draws = torch.Generator().manual_seed(0)
    unmasked = model.generate(x, max_new_tokens=16, temperature=1.0, generator=draws)[0, x.shape[1] :]
    assert bool((unmasked >= size).any())  # what the loop would decode without the limit...
    with pytest.raises(IndexError):
        tokenizer.decode(unmasked.tolist())  # ...and how sentencepiece refuses it
    for kw in ({}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 2 * size}, {"num_beams": 3}):
        out = io.StringIO()
        generator = torch.Generator().manual_seed(0)
        new = stream(model, tokenizer, "the cat", out, 16, generator=generator, **kw)
        assert len(new) == 16 and all(0 <= i < size for i in new), kw
        assert out.getvalue() == tokenizer.decode(x[0].tolist() + new)[len("the cat") :], kw
    sampled = model.generate(x, max_new_tokens=24, temperature=1.0, vocab_size=size)
    assert int(sampled[0, x.shape[1] :].max()) < size
    assert torch.equal(model.generate(x, max_new_tokens=4, vocab_size=10**6)[0], model.generate(x, 4)[0])
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        model.generate(x, max_new_tokens=2, vocab_size=0)
