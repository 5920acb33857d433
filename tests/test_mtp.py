"""DeepSeek-V3's multi-token prediction (head ``mtp``: ``blocks/configs/mtp.py``, ``blocks/mtp.py``)
beyond what the registry-wide tests check for every head (counts, FLOPs, shapes, gradients, the
JSON Schema) and the zoo's spec tests (counts against transformers: ``tests/test_deepseek.py``):
the loss as the paper defines it, the training loss it joins, decoding without it, and Hugging
Face: a folder holding the MTP tensors imports with transformers' ``MtpModel``'s predictions,
exports back to the same tensors, and a folder without them imports as the main model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.heads import HeadContext
from yamlformer.blocks.mtp import IGNORE, _targets
from yamlformer.builder import build_model, load_spec

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "specs" / "deepseek-v3.yaml"
TINY = ROOT / "specs" / "tiny" / "deepseek-v3.yaml"


def _model(overrides=None, seed: int = 0):
    spec = load_spec(TINY, overrides=overrides)
    torch.manual_seed(seed)
    return spec, build_model(spec, attention_backend="eager").eval()


def _ids(spec, batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_zoo_spec_predicts_one_more_token_with_a_layer_of_its_own():
    spec = load_spec(ZOO)
    head = spec.head
    assert (head.type, head.num_nextn_predict_layers, head.loss_weight) == ("mtp", 1, 0.3)
    assert head.layer.attention == spec.decoder.attention and head.layer.ffn == spec.decoder.ffn  # the MoE layer
    assert head.layer.norm == spec.decoder.norm


def _reference_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The paper's section 2.2 written out on the valid positions only: module k sees positions
    0 .. T-k-1 (where token t + k exists), predicts token t + k + 1 where it exists."""
    head, stack = model.head, model.decoder
    seq, depth = ids.shape[1], len(model.head.mtp)
    hidden = stack(ids)  # h^0: the main model's output, as the head gets it
    total = 0.0
    for k, module in enumerate(head.mtp, start=1):
        length = seq - k
        positions = torch.arange(length).expand(ids.shape[0], length)
        inputs = AttentionInputs(0, length, positions=positions, position=stack.position)
        embedded = stack.embedding(ids[:, k:])
        x = module.eh_proj(torch.cat((module.enorm(embedded), module.hnorm(hidden[:, :length])), dim=-1))
        hidden = module.layer(x, inputs)
        logits = head.proj(module.norm(hidden))[:, : length - 1]
        total = total + F.cross_entropy(logits.flatten(0, 1), ids[:, k + 1 :].flatten())
    return total * head.loss_weight / depth


@pytest.mark.parametrize("depth", [1, 2])
def test_the_loss_is_the_papers(depth):
    spec, model = _model({"head.num_nextn_predict_layers": depth, "head.loss_weight": 0.1})
    ids = _ids(spec)
    with torch.no_grad():
        model(ids)
        loss = model.aux_losses()["mtp"]
        torch.testing.assert_close(loss, _reference_loss(model, ids), rtol=1e-5, atol=1e-6)
    assert loss > 0


def test_targets_stay_inside_the_window_the_document_and_the_padding():
    ids = torch.arange(10, 16)[None]  # (1, 6)
    assert _targets(ids, 2, None, None).tolist() == [[12, 13, 14, 15, IGNORE, IGNORE]]
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert _targets(ids, 2, None, documents).tolist() == [[12, IGNORE, IGNORE, 15, IGNORE, IGNORE]]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    assert _targets(ids, 2, mask, None).tolist() == [[12, 13, IGNORE, IGNORE, IGNORE, IGNORE]]


def test_packed_documents_predict_within_their_document():
    """A packed row's MTP loss is what each document's is alone (the same positions, targets and
    attention): two documents packed, against the two run apart."""
    spec, model = _model()
    a, b = _ids(spec, 1, 7, seed=2), _ids(spec, 1, 5, seed=3)
    with torch.no_grad():
        model(torch.cat((a, b), dim=1), document_ids=torch.tensor([[0] * 7 + [1] * 5]))
        packed = model.aux_losses()["mtp"]
        apart = []
        for doc in (a, b):
            model(doc)
            apart.append(model.aux_losses()["mtp"])
    # mean over the packed row's 5 + 3 targets = the documents' means weighted by their targets
    torch.testing.assert_close(packed, (5 * apart[0] + 3 * apart[1]) / 8, rtol=1e-4, atol=1e-6)


def test_training_adds_the_weighted_losses(tmp_path):
    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.learning.module import LMModule
    from yamlformer.recipes.tasks import load_recipe

    spec, model = _model()
    model.train()
    module = LMModule(model, load_recipe(tiny_recipe(tmp_path, loss={"moe_aux_coef": 0.5})).recipe, meta={})
    assert module.adds_aux_losses  # the balancing loss and the head's
    ids = _ids(spec, seq=13)
    loss, ce = module._losses(ids[:, :-1], ids[:, 1:])
    losses = model.aux_losses()
    assert set(losses) == {"mtp", "moe_balance"}
    torch.testing.assert_close(loss, ce + model.aux_losses(balance_weight=0.5)["moe_balance"] + losses["mtp"])
    torch.testing.assert_close(losses["moe_balance"], model.aux_loss())  # unweighted by default
    loss.backward()
    assert all(p.grad is not None for p in model.head.mtp.parameters())


def test_decoding_uses_the_main_head_only():
    spec, model = _model()
    calls = []
    model.head.mtp[0].register_forward_hook(lambda *a: calls.append(1))
    prompt = _ids(spec, seq=5)
    model.generate(prompt, max_new_tokens=6)  # the prefill and every step use the cache
    assert not calls and "mtp" not in model.aux_losses()  # (the MoE blocks' balancing loss stays)
    with torch.no_grad():
        logits = model(prompt)  # a forward without a cache runs the module, and returns the main logits
    assert calls and torch.equal(logits, model.head.proj(model.decoder(prompt)))


def test_builder_compare_counts_the_modules_exactly(capsys):
    from yamlformer.builder.cli import main

    assert main(["compare", str(TINY), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    head = next(row for row in result["components"] if row["component"] == "head")
    assert head["match"] and head["actual"] > spec_projection(load_spec(TINY))


def test_describe_shows_the_modules_as_their_own_row_and_the_main_models_total(capsys, monkeypatch):
    """They were folded into `head` (12,536,747,008, total 682,636,472,320); the paper's 671B is
    the main model, what decoding runs."""
    from yamlformer.builder.analysis.estimates import estimate
    from yamlformer.builder.cli import main

    spec, model = _model()
    est = estimate(spec)
    built = sum(p.numel() for name, p in model.named_parameters() if name.startswith("head.mtp."))
    assert est.params.auxiliary == {"head.mtp": built}
    assert est.params.main == est.params.total - built
    flops_without = estimate(load_spec(TINY, overrides={"head": {"type": "lm"}})).flops.by_component["head"]
    assert est.flops.auxiliary["head.mtp"] == est.flops.by_component["head"] - flops_without
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["describe", str(ZOO), "--json"]) == 0
    params = json.loads(capsys.readouterr().out)["params"]
    assert params["total"] == 682_636_472_320 and round(params["main"] / 1e9) == 671
    assert params["auxiliary"] == {"head.mtp": params["total"] - params["main"]}
    assert main(["describe", str(ZOO)]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3}
    assert f"{params['by_component']['head'] - params['auxiliary']['head.mtp']:,}" in rows["head"]
    assert f"{params['auxiliary']['head.mtp']:,}" in rows["head.mtp (training only)"]
    assert f"{params['main']:,}" in rows["main-model params"]


def spec_projection(spec) -> int:
    return spec.d_model * spec.vocab_size


# -- Hugging Face ----------------------------------------------------------------------------------


def _hf_main(transformers):
    """A random tiny DeepseekV3ForCausalLM (layer 0 dense, layer 1 MoE), as a folder would hold it."""
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        num_nextn_predict_layers=1,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def _mtp_checkpoint_names(mtp_state: dict, layer: int) -> dict:
    """An MtpModel's state dict under the checkpoint's names (``model.layers.{layer}.``, experts
    one tensor each, as DeepSeek's released checkpoint stores them)."""
    out = {}
    for name, tensor in mtp_state.items():
        rest = name.removeprefix("layers.0.")
        if rest.startswith("mtp_block.mlp.experts."):
            kind = rest.rsplit(".", 1)[1]  # gate_up_proj | down_proj
            for e, expert in enumerate(tensor):
                block = f"model.layers.{layer}.mlp.experts.{e}"
                if kind == "gate_up_proj":
                    gate, up = expert.chunk(2, dim=0)
                    out[f"{block}.gate_proj.weight"], out[f"{block}.up_proj.weight"] = gate, up
                else:
                    out[f"{block}.down_proj.weight"] = expert
            continue
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        out[f"model.layers.{layer}.{rest}"] = tensor
    return out


def _mtp_model(main, transformers):
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(1)
    mtp = MtpModel(main, 1).eval()
    with torch.no_grad():  # away from the init's ones and zeros
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")):
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.5 + torch.rand_like(p))
        for name, buffer in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)
    return mtp


def _write_folder(folder: Path, main, mtp, differing_copy: bool = False) -> None:
    """transformers' save of the main model, the MTP module's tensors added (the shared embedding
    and head stored again, as DeepSeek-V3's checkpoint does)."""
    from safetensors.torch import load_file, save_file

    main.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    layer = main.config.num_hidden_layers
    state = {k: v for k, v in mtp.state_dict().items() if not k.startswith(("embed_tokens", "shared_head"))}
    tensors.update(_mtp_checkpoint_names(state, layer))
    embedding = tensors["model.embed_tokens.weight"]
    tensors[f"model.layers.{layer}.embed_tokens.weight"] = embedding + (1.0 if differing_copy else 0.0)
    tensors[f"model.layers.{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def _their_predictions(main, mtp, ids: torch.Tensor) -> torch.Tensor:
    """transformers' MtpModel: module 1's logits at positions 0 .. T-2 (token t + 2)."""
    seq = ids.shape[1]
    with torch.no_grad():
        last = main.model(ids).last_hidden_state[:, : seq - 1]
        positions = torch.arange(seq - 1)[None]
        return mtp._project_to_logits(mtp.forward_layer(0, last, positions, None, input_ids=ids[:, 1:]))


def _our_predictions(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden, inputs = model.decoder.run(ids)
        context = HeadContext(ids, model.decoder.embedding, inputs)
        return model.head.predictions(hidden, context)[0][:, : ids.shape[1] - 1]


def test_import_reads_the_mtp_weights_with_transformers_predictions(tmp_path, capsys):
    """`builder import-hf` on a DeepSeek-V3 folder holding model.layers.2 (the MTP module): the
    spec has the mtp head, and its predictions are transformers' MtpModel's."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(__import__("transformers.modeling_layers").modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    from yamlformer.builder.cli import main as cli
    from yamlformer.builder.hf import load_weights

    main = _hf_main(transformers)
    mtp = _mtp_model(main, transformers)
    _write_folder(tmp_path / "hf", main, mtp)
    assert cli(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "ours")]) == 0
    spec = load_spec(tmp_path / "ours" / "spec.yaml")
    assert spec.head.type == "mtp" and spec.head.num_nextn_predict_layers == 1
    ours = load_weights(build_model(spec, attention_backend="eager"), tmp_path / "ours" / "model.safetensors").eval()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(4))
    theirs = _their_predictions(main, mtp, ids)
    assert theirs.std() > 0.1
    torch.testing.assert_close(_our_predictions(ours, ids), theirs, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), main(ids).logits, rtol=1e-4, atol=1e-4)

    # and back: export writes every tensor the folder held, the shared ones again
    from safetensors.torch import load_file

    assert cli(["export-hf", str(tmp_path / "ours" / "spec.yaml"), "-o", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    written, read = load_file(tmp_path / "back" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == read.keys()
    for name, tensor in read.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["mtp_loss_weight"] == 0.3


def test_a_folder_without_the_mtp_tensors_imports_as_the_main_model(tmp_path):
    """transformers saves the main model alone, its config still saying num_nextn_predict_layers 1."""
    transformers = pytest.importorskip("transformers")
    from yamlformer.builder.hf import from_hf

    main = _hf_main(transformers)
    main.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    spec, _ = from_hf(tmp_path / "hf")
    assert spec.head.type == "lm"


def test_copies_of_the_shared_embedding_must_agree(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(__import__("transformers.modeling_layers").modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    from yamlformer.builder.hf import HFError, from_hf

    main = _hf_main(transformers)
    _write_folder(tmp_path / "hf", main, _mtp_model(main, transformers), differing_copy=True)
    with pytest.raises(HFError, match=r"model\.layers\.2\.embed_tokens\.weight differs from model\.embed_tokens"):
        from_hf(tmp_path / "hf")


def test_the_zoo_tiny_spec_exports_its_modules_with_transformers_predictions(tmp_path):
    """Export (ours -> Hugging Face): the tiny zoo spec's module, read into transformers'
    MtpModel from the exported folder, predicts what ours does."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(__import__("transformers.modeling_layers").modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    from yamlformer.builder.hf import to_hf

    spec, ours = _model()
    with torch.no_grad():
        for p in ours.parameters():  # unit-scale weights: logits O(1)
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.5 + torch.rand_like(p))
        for module in ours.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.normal_(0, 0.3)
    assert to_hf(spec, ours, tmp_path / "out").model_type == "deepseek_v3"
    main = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    mtp = MtpModel(main, 1).eval()
    layer = spec.decoder.n_layers
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        prefix = f"model.layers.{layer}."
        if not name.startswith(prefix) or name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            continue
        rest = name.removeprefix(prefix)
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            state[f"layers.0.{rest}"] = tensor
        elif rest.startswith("shared_head.norm."):
            state["layers.0.post_norm.weight"] = tensor
        elif not rest.startswith("mlp.experts."):
            state[f"layers.0.mtp_block.{rest}"] = tensor
    experts = spec.head.layer.ffn.n_experts
    gate_up, down = [], []
    for e in range(experts):
        block = f"model.layers.{layer}.mlp.experts.{e}"
        gate_up.append(torch.cat((tensors[f"{block}.gate_proj.weight"], tensors[f"{block}.up_proj.weight"])))
        down.append(tensors[f"{block}.down_proj.weight"])
    state["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack(down)
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith(("embed_tokens", "shared_head")) for name in missing)
    ids = _ids(spec, seq=14)
    theirs = _their_predictions(main, mtp, ids)
    assert theirs.std() > 0.1
    torch.testing.assert_close(_our_predictions(ours, ids), theirs, rtol=1e-4, atol=1e-4)
