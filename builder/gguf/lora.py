"""``builder export-gguf --adapters-only``: a model's LoRA adapters alone, as the GGUF LoRA
adapter llama.cpp applies over the base model's GGUF (``Llama(model_path=base.gguf,
lora_path=adapter.gguf)``, ``llama-cli --lora``), written as llama.cpp's
``convert_lora_to_gguf.py`` writes one: ``general.type`` ``adapter``, ``adapter.type`` ``lora``,
``adapter.lora.alpha``, and for each adapted base tensor ``<its GGUF name>.lora_a`` (rank, in) and
``.lora_b`` (out, rank), ``lora_b`` taking the rows' layout the base tensor takes (Llama's q/k
RoPE permutation).

The factors are PEFT's (:func:`yamlformer.builder.hf.peft.peft_tensors`, on the Hugging Face
family ``export-gguf`` writes the base as). llama.cpp scales ``B A`` by ``alpha / rank`` (rank:
``lora_b``'s columns); ``alpha`` is written so that this is the adapter's own scale
(``rank_scaled``: ``alpha * sqrt(rank)``), a module whose rank differs (layers fused into one
module) with its ``lora_b`` rescaled to match.
"""

from __future__ import annotations

from pathlib import Path

from yamlformer.builder.gguf.export import OUTTYPES, GGUFError, Plan, gguf_module, merged_spec, plan, write_file


def lora_plan(spec) -> Plan:
    """The base's plan for ``spec``'s adapters written alone, or one line of why llama.cpp cannot
    apply them (:class:`GGUFError`); needs neither weights nor ``gguf``."""
    config = spec.adapters
    if config is None:
        raise GGUFError("--adapters-only: the model has no adapters (its spec has no `adapters`); export it without")
    if config.type != "lora":
        raise GGUFError(
            f"adapters.type: {config.type}; llama.cpp applies LoRA (W + scale * B A) only, "
            "DoRA's magnitudes have no GGUF adapter form: export --merge instead"
        )
    if config.scale() == 0:
        raise GGUFError("adapters.alpha: 0; the adapters change nothing (llama.cpp reads alpha 0 as scale 1)")
    chosen = plan(merged_spec(spec), None)
    if chosen.family not in chosen.arch.lora:
        proven = ", ".join(sorted(chosen.arch.lora))
        raise GGUFError(
            f"--adapters-only: the base is Hugging Face {chosen.family}; a GGUF LoRA adapter for llama.cpp's "
            f"{chosen.arch.name.lower()} is written (and proven) {f'for {proven} only' if proven else 'for none yet'}: "
            "export --merge instead"
        )
    return chosen


def write_lora(spec, state: dict, out: str | Path, outtype: str = "f32", description: str = "") -> Plan:
    """Write ``spec``'s adapters (their tensors in ``state``) as a GGUF LoRA adapter ``out``."""
    gguf = gguf_module()
    if outtype not in OUTTYPES:
        raise GGUFError(f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    chosen = lora_plan(spec)
    # local: torch and the HF writers load when weights are converted
    import torch

    from yamlformer.builder.hf.common import HFError
    from yamlformer.builder.hf.peft import PREFIX, peft_tensors
    from yamlformer.builder.hf.writer import choose_family

    config = chosen.config
    family, _ = choose_family(spec)
    try:
        factors, _ = peft_tensors(spec, state, family)
    except HFError as exc:
        raise GGUFError(str(exc)) from None
    adapters = spec.adapters
    alpha = adapters.scale() * adapters.rank  # llama.cpp's alpha / rank is then our scale
    model_arch = getattr(gguf.MODEL_ARCH, chosen.arch.name)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    out_tensors = []
    for key in sorted(k for k in factors if k.endswith(".lora_A.weight")):
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        a = factors[key].detach().to(torch.float32).cpu()
        b = factors[f"{PREFIX}{module}.lora_B.weight"].detach().to(torch.float32).cpu()
        b = b * (adapters.scale() * b.shape[1] / alpha)  # 1 unless the module's rank is another
        ((hf_name, b),) = chosen.arch.transform(f"{module}.weight", b, config)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise GGUFError(f"adapter on {module}: llama.cpp's {chosen.arch.name.lower()} has no tensor of that name")
        out_tensors += [(f"{gguf_name}.lora_a", a.numpy()), (f"{gguf_name}.lora_b", b.numpy())]
    matrix_type, _ = OUTTYPES[outtype]

    def fill(writer):
        writer.add_name(f"{spec.name} adapters")
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        if description:
            writer.add_description(description)

    write_file(gguf, out, model_arch, fill, out_tensors, matrix_type)
    return chosen
