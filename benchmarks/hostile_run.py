"""A hostile user against the wave-4 commands: adapters (LoRA, DoRA, QLoRA fields), ``task: sft``
data (malformed JSON Lines, huge lines, wrong types, chat templates that try to run code),
``import-hf`` of PEFT folders (hostile adapter_config.json, pickles, missing files, links),
``export-hf --adapters-only/--merge`` onto existing folders, optimizers and their options, muP,
``--cooldown-from``, ``plan --calibrate`` and the attention tuning cache, each case one real
``builder`` command (or, for the tuning cache, the cache's own reader and writer), bounded
in time (in this process, one case after another, each under an alarm), and its outcome counted:

  clear       refused in a few located lines (exit 1, or 2 for an argument), or accepted where
              the input is fine
  traceback   a Python traceback, the CLI's last-resort "internal error", or another exit status
  hang        ran past the time limit
  silent      accepted (exit 0) what should be refused
  lost        a file the user had (a model, a folder given to --out) changed or gone
  executed    the input ran code (a marker file written by the payload)
  leak        a user file's content (a secret planted in it) printed
  disagrees   ``train --dry-run`` and ``train`` gave different verdicts

    python benchmarks/hostile_run.py                 # every case, the table of counts
    python benchmarks/hostile_run.py --only sft -v   # the cases whose name holds "sft", each outcome
    python benchmarks/hostile_run.py --json out.json

About 10 minutes on 2 busy CPU cores (a case the dry run accepts also trains, 2 steps).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SECRET = "HOSTILE-SECRET-7f3a9c"  # planted in the hostile files: printed back, it is a leak
OUTCOMES = ("clear", "traceback", "hang", "silent", "lost", "executed", "leak", "disagrees")
SECONDS = 90.0

sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny spec, not a copy of it
from recipe_helpers import TINY_SPEC  # noqa: E402


class Case:
    """One hostile input: ``argv`` for ``builder`` (or ``code`` for the interpreter), what it
    should do (``refuse``: exit 1 or 2; ``either``: a clean exit either way), the paths whose
    content must survive, and for a recipe the dry run compared with the run."""

    def __init__(self, name, argv=None, expect="refuse", protect=(), compare=False, code=None):
        self.name, self.argv, self.expect, self.protect = name, argv, expect, list(protect)
        self.compare, self.code = compare, code


# -- the files a case starts from --------------------------------------------------------------------


def _payload(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"


class _Pickled:
    """A pickle that runs code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (_payload(self.marker),))


def _write_pickle(path: Path, marker: Path) -> Path:
    import pickle

    path.write_bytes(pickle.dumps({"state_dict": _Pickled(marker), "note": SECRET}))
    return path


def _recipe(folder: Path, name: str, **sections) -> Path:
    """A tiny recipe: an LM on 60 kB of the standard library, char tokenizer; sections replace."""
    folder = folder / name
    folder.mkdir(parents=True)
    recipe = {
        "name": "tiny",
        "model": {"spec": copy.deepcopy(TINY_SPEC)},
        "data": {"sources": ["python-stdlib"], "max_bytes": 60_000, "seq_len": 32, "batch_size": 4},
        "tokenizer": {"type": "char"},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 1},
        "trainer": {
            "max_steps": 2,
            "val_check_interval": 2,
            "limit_val_batches": 1,
            "checkpoint_every_n_steps": 2,
            "log_every_n_steps": 1,
            "accelerator": "cpu",
            "precision": "32",
            "devices": 1,
            "output_dir": str(folder / "run"),
        },
    }
    for key, value in sections.items():
        if value is None:
            recipe.pop(key, None)
        elif isinstance(value, dict) and isinstance(recipe.get(key), dict) and not value.pop("_replace", False):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    recipe["data"]["cache_dir"] = str(folder / "cache")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _train(name, recipe, expect="refuse", extra=()):
    return Case(name, ["train", recipe, "--no-samples", *extra], expect, compare=True)


def _hf_tokenizer(folder: Path, template) -> Path:
    """A Hugging Face tokenizer folder (byte-level characters, specials) with ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789#:.?\n'\"{}[]()<>|_-=+,!"))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _records(path: Path, lines) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


GOOD = [json.dumps({"prompt": f"what is {i} plus one", "response": f"it is {i + 1}"}) for i in range(40)]


def _sft(tmp: Path, name: str, file: Path, tokenizer=None) -> Path:
    data = {"_replace": True, "file": str(file), "seq_len": 128, "batch_size": 4}
    spec = {**copy.deepcopy(TINY_SPEC), "max_seq_len": 128}
    return _recipe(tmp, name, task="sft", data=data, tokenizer=tokenizer or {"type": "char"}, model={"spec": spec})


def _base_models(tmp: Path) -> dict:
    """A tiny Llama with trained-looking LoRA adapters: its import-hf-style folder (spec.yaml with
    the adapters and model.safetensors), the base's Hugging Face export and the adapters' PEFT
    folder, written by the real commands."""
    import torch

    from yamlformer.blocks.linear import adapter_parameters
    from yamlformer.builder import build_model, load_spec
    from yamlformer.builder.cli import main
    from yamlformer.builder.hf import save_weights

    adapters = {"type": "lora", "rank": 4, "alpha": 8, "targets": "all-linear"}
    spec = load_spec(REPO / "specs" / "tiny" / "llama.yaml", overrides={"adapters": adapters})
    model = build_model(spec, init_seed=0).eval()
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    adapted, base = tmp / "models" / "adapted", tmp / "models" / "base-spec"
    for folder, data, state in (
        (adapted, spec.model_dump(mode="json"), model.state_dict()),
        (
            base,
            {**spec.model_dump(mode="json"), "adapters": None},
            {k: v for k, v in model.state_dict().items() if ".adapter." not in k},
        ),
    ):
        folder.mkdir(parents=True)
        (folder / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        save_weights(state, folder / "model.safetensors")
    hf, peft = tmp / "models" / "base-hf", tmp / "models" / "peft"
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            assert main(["export-hf", str(base / "spec.yaml"), "-o", str(hf)]) == 0
            assert main(["export-hf", str(adapted / "spec.yaml"), "--adapters-only", "-o", str(peft)]) == 0
        finally:
            sys.stdout = stdout
    config = json.loads((peft / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(hf)
    (peft / "adapter_config.json").write_text(json.dumps(config))
    return {"adapted": adapted / "spec.yaml", "base": base / "spec.yaml", "hf": hf, "peft": peft}


def _peft_variant(tmp: Path, models: dict, name: str, change) -> Path:
    folder = tmp / "peft" / name
    shutil.copytree(models["peft"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    written = change(folder, config)
    if written is not False:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _user_folder(path: Path) -> Path:
    """A folder of the user's own files (``--out`` aimed at it must not lose them)."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text(f"my notes {SECRET}\n")
    (path / "model.safetensors").write_bytes(b"my own model, not the export")
    return path


# -- the cases ---------------------------------------------------------------------------------------


def adapter_cases(tmp: Path) -> list[Case]:
    base = {"type": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    variants = {
        "rank 0": {"rank": 0},
        "rank -1": {"rank": -1},
        "rank 10**9": {"rank": 10**9},
        "rank as text": {"rank": "16"},
        "rank 2.5": {"rank": 2.5},
        "alpha 0": {"alpha": 0},
        "alpha inf": {"alpha": float("inf")},
        "alpha nan": {"alpha": float("nan")},
        "dropout 1": {"dropout": 1.0},
        "dropout -0.1": {"dropout": -0.1},
        "no targets": {"targets": []},
        "an empty target": {"targets": [""]},
        "a target up the tree": {"targets": ["../../etc/passwd"]},
        "a target with a shell command": {"targets": ["q_proj; rm -rf ~"]},
        "a backwards range": {"targets": ["decoder.layers.5-1.attention"]},
        "a range past the layers": {"targets": ["decoder.layers.0-999999999999.attention"]},
        "targets a word": {"targets": "everything"},
        "a target that matches nothing": {"targets": ["no_such_proj"]},
        "300 targets": {"targets": [f"layer{i}" for i in range(300)]},
        "a 5000-character target": {"targets": ["q" * 5000]},
        "type qlora (no such type)": {"type": "qlora"},
        "type as a module path": {"type": "os:system"},
        "quantize int4": {"quantize": "int4"},
        "quantize nf4 on dora": {"type": "dora", "quantize": "nf4"},
        "rank_scaled as text": {"rank_scaled": "yes"},
        "an unknown key": {"init": "gaussian"},
    }
    fine = {"quantize nf4 on dora"}  # QLoRA's base under DoRA's adapters: PEFT trains it too
    cases = []
    for name, change in variants.items():
        recipe = _recipe(tmp, f"adapters-{len(cases)}", model={"adapters": {**base, **change}})
        cases.append(_train(f"adapters: {name}", recipe, "either" if name in fine else "refuse"))
    for name, value in {"adapters a string": "lora", "adapters a list": [base]}.items():
        cases.append(_train(f"adapters: {name}", _recipe(tmp, f"adapters-{len(cases)}", model={"adapters": value})))
    return cases


def sft_cases(tmp: Path) -> list[Case]:
    folder = tmp / "sft-data"
    folder.mkdir()
    marker = tmp / "EXECUTED-sft"
    files = {
        "a line that is not JSON": _records(folder / "a.jsonl", [*GOOD[:5], f"not json {SECRET}", *GOOD[5:]]),
        "an empty file": _records(folder / "b.jsonl", []),
        "blank lines only": _records(folder / "c.jsonl", ["", "  ", ""]),
        "a 64 MB line": _records(
            folder / "d.jsonl", [*GOOD, json.dumps({"prompt": "x" * (64 << 20), "response": "y"})]
        ),
        "bytes that are not UTF-8": _records(folder / "e.jsonl", [*GOOD, b'{"prompt": "\xff\xfe", "response": "x"}']),
        "a record that is a list": _records(folder / "f.jsonl", [*GOOD, json.dumps(["a", "b"])]),
        "a prompt that is a number": _records(folder / "g.jsonl", [*GOOD, json.dumps({"prompt": 3, "response": "x"})]),
        "a response that is null": _records(folder / "h.jsonl", [*GOOD, json.dumps({"prompt": "a", "response": None})]),
        "no response field": _records(folder / "i.jsonl", [*GOOD, json.dumps({"prompt": SECRET})]),
        "a message of an unknown role": _records(
            folder / "j.jsonl", [*GOOD, json.dumps({"messages": [{"role": "root", "content": SECRET}]})]
        ),
        "a message whose content is a mapping": _records(
            folder / "k.jsonl",
            [
                *GOOD,
                json.dumps(
                    {"messages": [{"role": "user", "content": {"x": 1}}, {"role": "assistant", "content": "y"}]}
                ),
            ],
        ),
        "JSON nested 100000 deep": _records(folder / "l.jsonl", [*GOOD, "[" * 100_000 + "]" * 100_000]),
        "a NaN": _records(folder / "m.jsonl", [*GOOD, '{"prompt": NaN, "response": "x"}']),
        "a number of 10**6 digits": _records(folder / "n.jsonl", [*GOOD, '{"prompt": ' + "9" * 1_000_000 + "}"]),
        "a byte-order mark": _records(folder / "o.jsonl", [b"\xef\xbb\xbf" + GOOD[0].encode(), *GOOD[1:]]),
        "CRLF line ends": _records(folder / "p.jsonl", [line + "\r" for line in GOOD]),
        "a damaged gzip": folder / "q.jsonl.gz",
        "a damaged zstd": folder / "r.jsonl.zst",
        "a Parquet file of random bytes": folder / "s.parquet",
        "records in a .txt file": _records(folder / "t.txt", GOOD),
        "an empty prompt and response": _records(
            folder / "u.jsonl", [*GOOD, json.dumps({"prompt": "", "response": ""})]
        ),
        "a record of 10000 messages": _records(
            folder / "v.jsonl",
            [
                *GOOD,
                json.dumps(
                    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 5000}
                ),
            ],
        ),
    }
    (folder / "q.jsonl.gz").write_bytes(gzip.compress("\n".join(GOOD).encode())[:-20])
    (folder / "r.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(200))
    (folder / "s.parquet").write_bytes(b"PAR1" + os.urandom(300) + b"PAR1")
    expect_ok = {"a byte-order mark", "CRLF line ends", "a record of 10000 messages", "an empty prompt and response"}
    cases = [
        _train(f"sft: {name}", _sft(tmp, f"sft-{i}", path), "either" if name in expect_ok else "refuse")
        for i, (name, path) in enumerate(files.items())
    ]
    good = _records(folder / "good.jsonl", GOOD)
    templates = {
        "a template reaching os through __globals__": "{{ cycler.__init__.__globals__.os.system('touch "
        + str(marker)
        + "') }}",
        "a template walking __subclasses__": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "a template importing through lipsum": "{{ lipsum.__globals__['os'].popen('touch " + str(marker) + "') }}",
        "a template looping 10**9 times": "{% for i in range(10**9) %}x{% endfor %}",
        "a template building a 1 GB string": "{{ 'a' * 10**9 }}",
        "a template that raises": "{{ raise_exception('" + SECRET + "') }}",
        "a template of bad syntax": "{% for m in messages %}{{ m['content'] ",
        "a template that writes nothing": "",
        "a template that is a number": 42,
        "a template ignoring the answers": (
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
        ),
    }
    for i, (name, template) in enumerate(templates.items()):
        tokenizer = {"type": "hf", "model_file": str(_hf_tokenizer(tmp / "tokenizers" / str(i), template))}
        expect = "either" if template == "" else "refuse"  # an empty template is none: the default's
        cases.append(_train(f"sft chat template: {name}", _sft(tmp, f"sft-template-{i}", good, tokenizer), expect))
    return cases


def peft_cases(tmp: Path, models: dict) -> list[Case]:
    marker = tmp / "EXECUTED-peft"
    hf = str(models["hf"])

    def config(**values):
        return lambda folder, c: c.update(values)

    def remove(name):
        return lambda folder, c: (folder / name).unlink()

    def replace(name, make):
        def change(folder, c):
            (folder / name).unlink()
            make(folder / name)
            return False if name == "adapter_config.json" else None  # the config made here is kept

        return change

    def truncated(folder, c):
        path = folder / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[:100])

    def huge_header(folder, c):
        (folder / "adapter_model.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")

    def wrong_shapes(folder, c):
        from safetensors.numpy import load_file, save_file

        state = load_file(str(folder / "adapter_model.safetensors"))
        save_file({k: v[:1] for k, v in state.items()}, str(folder / "adapter_model.safetensors"))

    def fifo(path):
        os.mkfifo(path)

    def loop(path):
        path.symlink_to(path.with_name("other"))
        path.with_name("other").symlink_to(path)

    def sock(path):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))

    def instead(name, make):  # the config replaced by something else: not written back
        def change(folder, c):
            (folder / name).unlink()
            make(folder / name)
            return False

        return change

    def secret_link(path):
        target = path.parent.with_name(f"{path.parent.name}-secret")
        target.write_text(f"{SECRET}\n{SECRET}")
        path.symlink_to(target)

    variants = {
        "adapter_config.json not JSON": replace("adapter_config.json", lambda p: p.write_text(f"{{ {SECRET}")),
        "adapter_config.json a list": replace("adapter_config.json", lambda p: p.write_text("[1, 2]")),
        "r -1": config(r=-1),
        "r 10**9": config(r=10**9),
        "r as text": config(r="4"),
        "lora_alpha as text": config(lora_alpha="eight"),
        "target_modules a regex": config(target_modules=".*"),
        "target_modules of no layer": config(target_modules=["no_such_proj"]),
        "peft_type PROMPT_TUNING": config(peft_type="PROMPT_TUNING"),
        "use_dora on LoRA weights": config(use_dora=True),
        "modules_to_save": config(modules_to_save=["lm_head"]),
        "fan_in_fan_out": config(fan_in_fan_out=True),
        "rank_pattern": config(rank_pattern={"q_proj": 8}),
        "base_model_name_or_path /etc": config(base_model_name_or_path="/etc"),
        "base_model_name_or_path up the tree": config(base_model_name_or_path="../../../../"),
        "base_model_name_or_path a hub name": config(base_model_name_or_path="meta-llama/Llama-3-8B"),
        "base_model_name_or_path /dev/zero": config(base_model_name_or_path="/dev/zero"),
        "adapter_model.bin a pickle that runs code": lambda folder, c: (
            (folder / "adapter_model.safetensors").unlink(),
            _write_pickle(folder / "adapter_model.bin", marker),
        ),
        "no adapter_model.safetensors": remove("adapter_model.safetensors"),
        "no adapter_config.json": lambda folder, c: (folder / "adapter_config.json").unlink() or False,
        "adapter_model.safetensors truncated": truncated,
        "adapter_model.safetensors of a 2**62-byte header": huge_header,
        "adapter_model.safetensors of wrong shapes": wrong_shapes,
        "adapter_config.json a link to a secret": instead("adapter_config.json", secret_link),
        "adapter_model.safetensors a link to /dev/zero": replace(
            "adapter_model.safetensors", lambda p: p.symlink_to("/dev/zero")
        ),
        "adapter_config.json a loop of links": instead("adapter_config.json", loop),
        "adapter_config.json a FIFO": instead("adapter_config.json", fifo),
        "adapter_model.safetensors a socket": replace("adapter_model.safetensors", sock),
        "adapter_config.json of 64 MB": config(padding="x" * (64 << 20)),
    }
    cases = []
    for i, (name, change) in enumerate(variants.items()):
        folder = _peft_variant(tmp, models, f"v{i}", change)
        argv = ["import-hf", folder, "-o", tmp / "imports" / f"v{i}"]
        if "base_model_name_or_path" not in name:
            argv += ["--base", hf]
        cases.append(Case(f"import-hf PEFT: {name}", argv, protect=[models["hf"]]))
    own = _peft_variant(tmp, models, "own", lambda f, c: None)
    cases.append(
        Case(
            "import-hf PEFT: --out the PEFT folder itself", ["import-hf", own, "-o", own, "--overwrite"], protect=[own]
        )
    )
    cases.append(
        Case(
            "import-hf PEFT: --out the base's folder",
            ["import-hf", own, "-o", hf, "--overwrite", "--base", hf],
            protect=[models["hf"]],
        )
    )
    user = _user_folder(tmp / "user-import")
    cases.append(
        Case(
            "import-hf PEFT: --out a folder of the user's files",
            ["import-hf", own, "-o", user, "--base", hf],
            protect=[user],
        )
    )
    cases.append(
        Case("import-hf PEFT: --base a file", ["import-hf", own, "-o", tmp / "imports" / "b", "--base", models["base"]])
    )
    return cases


def export_cases(tmp: Path, models: dict) -> list[Case]:
    adapted, base = models["adapted"], models["base"]
    marker = tmp / "EXECUTED-export"
    cases = []
    for mode in ("--adapters-only", "--merge"):
        user = _user_folder(tmp / f"user-export{mode}")
        cases += [
            Case(  # the adapters' two files beside the user's: refused only where one would be replaced
                f"export-hf {mode}: onto a folder of the user's files",
                ["export-hf", adapted, mode, "-o", user],
                "either" if mode == "--adapters-only" else "refuse",
                protect=[user],
            ),
            Case(
                f"export-hf {mode}: --overwrite onto a folder of the user's files",
                ["export-hf", adapted, mode, "-o", user, "--overwrite"],
                "either",
                protect=[user / "notes.txt"],
            ),
            Case(
                f"export-hf {mode}: onto the model's own folder",
                ["export-hf", adapted, mode, "-o", adapted.parent, "--overwrite"],
                "either" if mode == "--adapters-only" else "refuse",  # beside the model, none of its files
                protect=[adapted.parent],
            ),
            Case(f"export-hf {mode}: onto a file", ["export-hf", adapted, mode, "-o", adapted]),
            Case(f"export-hf {mode}: onto /dev/null", ["export-hf", adapted, mode, "-o", "/dev/null"]),
            Case(f"export-hf {mode}: under a file", ["export-hf", adapted, mode, "-o", adapted / "out"]),
            Case(
                f"export-hf {mode}: a model with no adapters", ["export-hf", base, mode, "-o", tmp / f"e{mode}-plain"]
            ),
        ]
    link = tmp / "export-link"
    _user_folder(tmp / "export-link-target")
    link.symlink_to(tmp / "export-link-target")
    cases.append(
        Case(
            "export-hf --merge: onto a link to the user's folder",
            ["export-hf", adapted, "--merge", "-o", link],
            protect=[tmp / "export-link-target"],
        )
    )
    cases.append(
        Case(
            "export-hf: --merge and --adapters-only",
            ["export-hf", adapted, "--merge", "--adapters-only", "-o", tmp / "e-both"],
        )
    )
    cases.append(Case("export-hf: neither on a model with adapters", ["export-hf", adapted, "-o", tmp / "e-neither"]))
    pickle_pt = _write_pickle(tmp / "weights.pt", marker)
    cases.append(
        Case(
            "export-hf: --weights a pickle that runs code",
            ["export-hf", base, "--weights", pickle_pt, "-o", tmp / "e-pickle"],
        )
    )
    cases.append(
        Case("export-hf: --weights /dev/zero", ["export-hf", base, "--weights", "/dev/zero", "-o", tmp / "e-zero"])
    )
    return cases


def optimizer_cases(tmp: Path) -> list[Case]:
    variants = {
        "type adam (no such type)": {"type": "adam"},
        "type as a module path": {"type": "subprocess:run"},
        "lr 0": {"lr": 0},
        "lr -1": {"lr": -1},
        "lr inf": {"lr": float("inf")},
        "lr as text": {"lr": "fast"},
        "betas [1, 0.9]": {"betas": [1.0, 0.9]},
        "three betas": {"betas": [0.9, 0.95, 0.99]},
        "eps 0": {"eps": 0},
        "weight_decay -1": {"weight_decay": -1},
        "muon ns_steps 0": {"type": "muon", "ns_steps": 0},
        "muon ns_steps 1000": {"type": "muon", "ns_steps": 1000},
        "muon adjust_lr unknown": {"type": "muon", "adjust_lr": "whatever"},
        "muon momentum 1": {"type": "muon", "momentum": 1.0},
        "sgd nesterov without momentum": {"type": "sgd", "momentum": 0, "nesterov": True},
        "sgd with betas": {"type": "sgd", "betas": [0.9, 0.9]},
    }
    cases = [
        _train(f"optimizer: {name}", _recipe(tmp, f"optim-{i}", optimizer={"_replace": True, **v}))
        for i, (name, v) in enumerate(variants.items())
    ]
    cases.append(_train("optimizer: a string", _recipe(tmp, "optim-str", optimizer="adamw")))
    return cases


def mup_cases(tmp: Path) -> list[Case]:
    variants = {
        "base_d_model 0": {"base_d_model": 0},
        "base_d_model larger than d_model": {"base_d_model": 4096, "base_hidden_dim": 64, "base_head_dim": 16},
        "base_head_dim as text": {"base_d_model": 16, "base_head_dim": "sixteen"},
        "output_multiplier -1": {"base_d_model": 16, "output_multiplier": -1.0},
        "output_multiplier inf": {"base_d_model": 16, "output_multiplier": float("inf")},
        "an unknown parametrization": {"type": "ntk"},
    }
    cases = []
    for i, (name, change) in enumerate(variants.items()):
        spec = {**copy.deepcopy(TINY_SPEC), "parametrization": {"type": "mup", **change}}
        cases.append(_train(f"muP: {name}", _recipe(tmp, f"mup-{i}", model={"spec": spec})))
    spec = {**copy.deepcopy(TINY_SPEC), "parametrization": {"type": "mup", "base_d_model": 16}}
    cases.append(
        _train("muP: with muon", _recipe(tmp, "mup-muon", model={"spec": spec}, optimizer={"type": "muon"}), "either")
    )
    return cases


def cooldown_cases(tmp: Path) -> list[Case]:
    marker = tmp / "EXECUTED-cooldown"
    recipe = _recipe(tmp, "cooldown", schedule={"type": "wsd", "warmup_steps": 1, "decay_steps": 1})
    folder = recipe.parent
    (folder / "random.ckpt").write_bytes(os.urandom(4096))
    (folder / "text.ckpt").write_text(f"{SECRET}\n" * 20)
    os.mkfifo(folder / "fifo.ckpt")
    fifo = folder / "fifo.ckpt"
    pickle_ckpt = _write_pickle(folder / "pickle.ckpt", marker)

    def run(name, ckpt, steps="2", expect="refuse", extra=()):
        return Case(
            f"--cooldown-from: {name}", ["train", recipe, "--cooldown-from", ckpt, "--steps", steps, *extra], expect
        )

    return [
        run("a checkpoint that is not there", folder / "missing.ckpt"),
        run("/dev/zero", "/dev/zero"),
        run("a FIFO", fifo),
        run("random bytes", folder / "random.ckpt"),
        run("a text file", folder / "text.ckpt"),
        run("a pickle that runs code", pickle_ckpt),
        run("a folder", folder),
        run("--steps 0", folder / "random.ckpt", "0"),
        run("--steps -5", folder / "random.ckpt", "-5"),
        run("--steps 1e9", folder / "random.ckpt", "1e9"),
        run("--steps 10**12", folder / "random.ckpt", str(10**12)),
        run("with --dry-run", folder / "random.ckpt", extra=["--dry-run"]),
        run("with --resume", folder / "random.ckpt", extra=["--resume"]),
        Case("--cooldown-from: --steps without it", ["train", recipe, "--steps", "3"]),
    ]


def plan_cases(tmp: Path) -> list[Case]:
    spec = REPO / "specs" / "tiny" / "llama.yaml"
    tables = tmp / "calibration"
    tables.mkdir()
    bad = {
        "not YAML": f"{{ {SECRET}",
        "a list": "[1, 2, 3]",
        "billion laughs": "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)),
        "negative rates": "gpu: H100\ngemm: {bf16: -1.0}\nhbm_bandwidth: -5\n",
        "a Python object tag": "!!python/object/apply:os.system ['touch " + str(tmp / "EXECUTED-plan") + "']\n",
    }
    cases = []
    for i, (name, text) in enumerate(bad.items()):
        folder = tables / str(i)
        folder.mkdir()
        for gpu in ("h100.yaml", "H100.yaml", "nvidia-h100.yaml", "cpu.yaml"):
            (folder / gpu).write_text(text)
        cases.append(
            Case(
                f"plan: a calibration table {name}",
                ["plan", spec, "--gpus", "8", "--gpu", "H100", "--calibration-dir", folder],
                "either",
            )
        )
    (tmp / "a-file").write_text("x")
    cases += [
        Case("plan --calibrate: no GPU here", ["plan", "--calibrate", "--calibration-dir", tables / "none"]),
        Case(
            "plan --calibrate --cpu: --calibration-dir /dev/null",
            ["plan", "--calibrate", "--cpu", "--calibration-dir", "/dev/null"],
        ),
        Case(
            "plan --calibrate --cpu: --calibration-dir a file",
            ["plan", "--calibrate", "--cpu", "--calibration-dir", tmp / "a-file"],
        ),
        Case(
            "plan --calibrate --cpu: --calibration-dir under a file",
            ["plan", "--calibrate", "--cpu", "--calibration-dir", tmp / "a-file" / "x"],
        ),
        Case("plan: --gpus 0", ["plan", spec, "--gpus", "0"]),
        Case("plan: --gpus 10**12", ["plan", spec, "--gpus", str(10**12)]),
        Case("plan: --global-batch -1", ["plan", spec, "--gpus", "8", "--global-batch", "-1"]),
        Case("plan: --gpu-memory nonsense", ["plan", spec, "--gpus", "8", "--gpu-memory", "lots"]),
    ]
    return cases


TUNING = """
import json, os, sys
from pathlib import Path
import yamlformer.kernels.tuning as tuning
tuning.fingerprint = lambda: "fp"  # what a cached choice is keyed by (Triton's version on a GPU)
path = Path(sys.argv[1])
cache = tuning.DiskCache(path)
got = cache.get("gpu", "fwd", "key")
cache.put("gpu", "fwd", "key2", {"BLOCK_M": 64})
print("got", "a config" if got else "nothing")
"""


def tuning_cases(tmp: Path) -> list[Case]:
    folder = tmp / "tuning"
    folder.mkdir()
    contents = {
        "not JSON": f"{{ {SECRET}",
        "a list": "[1, 2]",
        "a fingerprint holding a string": json.dumps({"fp": "x"}),
        "a GPU holding a list": json.dumps({"fp": {"gpu": [1]}}),
        "a kernel holding a number": json.dumps({"fp": {"gpu": {"fwd": 3}}}),
        "a config of hostile values": json.dumps(
            {"fp": {"gpu": {"fwd": {"key": {"BLOCK_M": -1, "num_warps": 10**9}}}}}
        ),
        "JSON nested 100000 deep": "[" * 100_000 + "]" * 100_000,
    }
    cases = []
    for i, (name, text) in enumerate(contents.items()):
        (folder / f"{i}.json").write_text(text)
        cases.append(Case(f"tuning cache: {name}", code=[TUNING, folder / f"{i}.json"], expect="either"))
    os.mkfifo(folder / "fifo.json")
    cases.append(Case("tuning cache: a FIFO", code=[TUNING, folder / "fifo.json"], expect="either"))
    (folder / "dir.json").mkdir()
    cases.append(Case("tuning cache: a folder", code=[TUNING, folder / "dir.json"], expect="either"))
    (folder / "loop.json").symlink_to(folder / "loop.json")
    cases.append(Case("tuning cache: a loop of links", code=[TUNING, folder / "loop.json"], expect="either"))
    return cases


# -- running and judging -----------------------------------------------------------------------------


def _digest(path: Path) -> dict[str, str]:
    """What is at ``path``: each file's digest by its path (a folder's files), to tell whether a
    command changed or removed one (a file added beside them loses nothing)."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path] if os.path.lexists(path) else []
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


class _Hung(BaseException):
    """Raised by the alarm: no ``except Exception`` on the way swallows it."""


def _alarm(signum, frame):
    raise _Hung


def _run(argv: list, cwd: Path, env: dict) -> tuple[int | None, str, float]:
    """``argv`` in this process (``builder`` through its ``main``, or ``python -c CODE ARGS``):
    its exit status (None: it ran past :data:`SECONDS`), what it printed, the seconds it took."""
    from yamlformer.builder.cli import main

    out = io.StringIO()
    started, here = time.perf_counter(), os.getcwd()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    status: int | None
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if argv[0] == "-c":
                    sys.argv = ["-c", *map(str, argv[2:])]
                    exec(compile(argv[1], "<case>", "exec"), {"__name__": "__main__"})
                    status = 0
                else:
                    status = main([str(a) for a in argv])
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except _Hung:
                status = None
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(here)
    return status, out.getvalue(), time.perf_counter() - started


def _verdict(status: int | None, text: str) -> str:
    if status is None:
        return "hang"
    if "Traceback" in text or "internal error" in text or status not in (0, 1, 2):
        return "traceback"
    return "ok" if status == 0 else "refused"


def judge(case: Case, tmp: Path, env: dict) -> dict:
    before = {str(p): _digest(Path(p)) for p in case.protect}
    markers = sorted(str(p) for p in tmp.glob("EXECUTED-*"))
    argv = ["-c", *case.code] if case.code is not None else list(case.argv)
    if case.compare:  # the dry run first; the run itself where the dry run accepts (it would train)
        status, text, seconds = _run([*argv, "--dry-run"], tmp, env)
        outcome = _verdict(status, text)
        if outcome == "ok":
            run_status, run_text, more = _run(argv, tmp, env)
            seconds += more
            text += "\n--- the run ---\n" + run_text
            ran = _verdict(run_status, run_text)
            status, outcome = run_status, "disagrees" if ran == "refused" else ran
    else:
        status, text, seconds = _run(argv, tmp, env)
        outcome = _verdict(status, text)
    after = {str(p): _digest(Path(p)) for p in case.protect}
    if sorted(str(p) for p in tmp.glob("EXECUTED-*")) != markers:
        outcome = "executed"
    elif any(after[p].get(f) != digest for p in before for f, digest in before[p].items()):
        outcome = "lost"
    elif outcome not in ("hang", "traceback", "disagrees") and SECRET in text:
        outcome = "leak"
    elif outcome == "ok":
        outcome = "silent" if case.expect == "refuse" else "clear"
    elif outcome == "refused":
        outcome = "clear"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return {"name": case.name, "outcome": outcome, "status": status, "seconds": round(seconds, 1), "said": lines[-3:]}


def cases(tmp: Path) -> list[Case]:
    models = _base_models(tmp)
    return [
        *adapter_cases(tmp),
        *sft_cases(tmp),
        *peft_cases(tmp, models),
        *export_cases(tmp, models),
        *optimizer_cases(tmp),
        *mup_cases(tmp),
        *cooldown_cases(tmp),
        *plan_cases(tmp),
        *tuning_cases(tmp),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="run the cases whose name holds this text")
    parser.add_argument("--json", type=Path, help="write every case's outcome here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each case's outcome and last lines")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-") as name:
        tmp = Path(name)
        os.environ.update(
            XDG_CACHE_HOME=str(tmp / "xdg-cache"),
            XDG_DATA_HOME=str(tmp / "xdg-data"),
            HF_HUB_OFFLINE="1",
            BUILDER_CALIBRATION_DIR=str(tmp / "calibration-default"),
        )
        os.environ.pop("BUILDER_DEBUG", None)
        results = []
        for case in (c for c in cases(tmp) if not args.only or args.only in c.name):
            r = judge(case, tmp, None)
            results.append(r)
            if args.verbose or r["outcome"] != "clear":  # as each ends: a long run shows its findings as it goes
                print(
                    f"{r['outcome']:10} {r['name']}  [{r['status']}, {r['seconds']} s]", file=sys.__stdout__, flush=True
                )
                for line in r["said"]:
                    print(f"           | {line[:300]}", file=sys.__stdout__, flush=True)
    counts = collections.Counter(r["outcome"] for r in results)
    print(f"\n{len(results)} cases")
    print("| outcome | cases |\n| --- | --- |")
    for outcome in OUTCOMES:
        print(f"| {outcome} | {counts.get(outcome, 0)} |")
    if args.json:
        args.json.write_text(json.dumps({"counts": dict(counts), "cases": results}, indent=1))
    return 0 if counts.get("clear", 0) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
