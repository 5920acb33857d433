"""``builder import-hf DIR -o OUT``: a local Hugging Face model folder as a spec and weights.

Writes ``OUT/spec.yaml`` and ``OUT/model.safetensors`` (our tensor names; load them with
``yamlformer.builder.hf.load_weights(build_model(load_spec("OUT/spec.yaml")), "OUT/model.safetensors")``),
plus the original ``config.json`` as ``hf_config.json`` and the tokenizer and generation files,
which ``export-hf`` carries back; ``builder generate OUT`` decodes with that tokenizer, and a
recipe trains with it (``tokenizer: {type: hf, model_file: OUT}``). Reads only local files inside
DIR; never the network. ``OUT`` is never ``DIR``; an earlier import there is replaced only with
``--overwrite``. Exit 1, with one line and no traceback, for an unsupported ``model_type``, a
config or checkpoint that does not match, weights holding NaN or infinite values, a tokenizer
that does not load, or an output it may not write.

A PEFT LoRA/DoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) imports over its
base model (``--base DIR``, else the local folder its ``base_model_name_or_path`` names): the
spec gets ``adapters`` and the weights hold the base's tensors and the adapters' (a recipe's
``model.init_from: OUT`` fine-tunes on from there; ``export-hf --merge`` folds them in). Its
``target_modules`` (matched as PEFT matches them: a list of names or their last dotted parts, a
string a regular expression of the whole name) must select exactly the modules the weights adapt,
``use_dora`` must agree with the ``lora_magnitude_vector`` tensors and ``fan_in_fan_out`` with the
layers (Conv1D or Linear); else exit 1 naming the field.
"""

from __future__ import annotations

import argparse
import sys

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.cli.arguments import output_folder, text
from yamlformer.builder.hf import HFError, import_hf
from yamlformer.builder.hf.peft import import_peft, is_peft_folder
from yamlformer.builder.hf.tokenizer import read_tokenizer, to_tokenizers
from yamlformer.builder.outputs import OutputError
from yamlformer.builder.spec.loader import SpecError, load_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR", help="a Hugging Face model folder (config.json, *.safetensors)")
    parser.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="OUT",
        type=output_folder,
        help="folder to write spec.yaml and model.safetensors",
    )
    parser.add_argument("--name", type=text(200, minimum=1), help="the spec's name (default: the folder's name)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier import in OUT (never DIR itself, nor a PEFT folder's base: refused even so)",
    )
    parser.add_argument(
        "--base",
        metavar="DIR",
        help="DIR is a PEFT adapter folder: the Hugging Face folder of its base model "
        "(default: its adapter_config.json's base_model_name_or_path)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if is_peft_folder(args.folder):
            spec_path, weights_path = import_peft(
                args.folder, args.out, args.base, name=args.name, overwrite=args.overwrite
            )
        elif args.base is not None:
            raise HFError(f"--base: {args.folder} is not a PEFT adapter folder (it has no adapter_config.json)")
        else:
            spec_path, weights_path = import_hf(args.folder, args.out, name=args.name, overwrite=args.overwrite)
        spec = load_spec(spec_path)
        tokenizer = read_tokenizer(args.out)
    except (HFError, SpecError, OutputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output folder: unwritable, full, or a path that cannot be made
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    params = estimate(spec).params.total
    print(f"{spec.name}: {spec.architecture}, {params:,} parameters")
    print(f"wrote {spec_path}")
    print(f"wrote {weights_path}")
    if tokenizer is None:
        print(
            f"no tokenizer in {args.folder} (tokenizer.json or tokenizer.model): generate and train need the "
            "model's own; copy the tokenizer files of the model it was trained from into it and import again "
            "with --overwrite (README.md, 'From a Hugging Face model to training on your files')"
        )
    else:
        size = to_tokenizers(tokenizer).get_vocab_size(with_added_tokens=True)
        print(f"tokenizer: {tokenizer['type']}, {size:,} tokens (builder generate {args.out} --prompt ...)")
    return 0
