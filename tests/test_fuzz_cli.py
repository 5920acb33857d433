"""Fuzzing the command line in-process: hypothesis writes hostile spec and recipe files (mutated
real ones, YAML tricks, other files' text) and hostile argument lists (every option of every
command, with values out of range, of the wrong kind, paths to what is not a file of ours), and
runs ``yamlformer.builder.cli.main`` on them. Whatever it draws, the command ends with a documented exit
status (0 done, 1 refused input, 2 malformed command line), prints no traceback and never the
last-resort "internal error", within a set time and a set growth of the process's peak memory.

The default run draws a few dozen cases per test (a few seconds); ``pytest -m slow`` runs the
same tests with many more, and adds the slower commands (eval over a corpus, describe --plot).
Training itself is replaced by a stub in the recipe fuzz: what is fuzzed is everything before
the trainer is made (loading and validating, the run folder, data, tokenizer and model).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import yaml
from hostile_helpers import REPO, bounded_run, clean, cli, lm_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recipe_helpers import tiny_recipe

from yamlformer.builder import load_spec

#: (default run, slow run) examples per test
EXAMPLES = {"fast": 30, "slow": 400}

SPECS = {
    p.stem: load_spec(p).model_dump(mode="json")
    for p in sorted((REPO / "specs" / "tiny").glob("*.yaml"))
    if p.stem in ("llama", "bert", "t5", "gpt2")
}


def profile(slow: bool):
    return settings(
        max_examples=EXAMPLES["slow" if slow else "fast"],
        deadline=None,
        derandomize=not slow,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- files a hostile user points at ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    """Paths that are not spec files of ours, by name; plus a tiny spec, a recipe and a checkpoint."""
    root = tmp_path_factory.mktemp("hostile")
    files = {}

    def write(name: str, data: bytes | str) -> None:
        files[name] = root / name
        (files[name].write_bytes if isinstance(data, bytes) else files[name].write_text)(data)

    write("spec.yaml", yaml.safe_dump(SPECS["llama"]))
    write("bert.yaml", yaml.safe_dump(SPECS["bert"]))
    write("secret.txt", "root:$6$salt$hash:19000:0:99999:7:::\n")
    write("empty.yaml", "")
    write("binary.bin", bytes(range(256)))
    write("list.yaml", "- a\n- b\n")
    write("json.json", '{"model_type": "gpt2", "n_embd": 1e400}')
    write("huge.yaml", "")
    with open(files["huge.yaml"], "r+") as f:
        f.truncate(8 << 20)  # sparse: refused from its size
    files["folder"] = root / "folder"
    files["folder"].mkdir()
    (files["folder"] / "config.json").write_text('{"model_type": "llama"}')
    files["readonly"] = root / "readonly"
    files["readonly"].mkdir()
    os.chmod(files["readonly"], stat.S_IRUSR | stat.S_IXUSR)
    files["missing"] = root / "missing.yaml"
    files["loop"] = root / "loop.yaml"
    files["loop"].symlink_to(root / "loop2.yaml")
    (root / "loop2.yaml").symlink_to(files["loop"])
    files["fifo"] = root / "fifo.yaml"
    os.mkfifo(files["fifo"])
    files["checkpoint"] = lm_checkpoint(root / "run")
    (root / "recipe").mkdir()
    files["recipe"] = tiny_recipe(root / "recipe")
    files["out"] = root / "out"
    if os.path.exists("/dev/zero"):
        files["zero"] = Path("/dev/zero")
    return files


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Relative paths a case writes land in a folder of its own."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- hostile values --------------------------------------------------------------------------------

#: text without path separators: a relative path made of it stays in the working folder
WORDS = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x00"), max_size=12)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 3, 7, 64, 10**9, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e30, 1e-30, 0.5, -0.0]),
)
SCALARS = st.one_of(
    NUMBERS,
    WORDS,
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            "512",
            "yes",
            "on",
            "true",
            ".inf",
            ".nan",
            "1e3",
            "0x10",
            "010",
            "~",
            "null",
            "1:8",
            "rope",
            "learned",
            "glu",
            "mlp",
            "rmsnorm",
            "layernorm",
            "decoder-only",
            "encoder-only",
            "encoder-decoder",
            "mla",
            "moe",
            "silu",
            "gelu",
            "relu",
            "pre",
            "post",
            "sandwich",
        ]
    ),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(WORDS, inner, max_size=3)),
    max_leaves=8,
)
#: YAML text that breaks a document, or tricks the loader
SNIPPETS = [
    "!!python/object/apply:os.system ['echo pwned']",
    "!!python/name:os.system",
    "&a [*a]",
    "*nowhere",
    "? [a, b]\n: c",
    "<<: *x",
    "\t",
    "%YAML 1.1\n---",
    "---\n---\n",
    "{",
    "]",
    "\ufeff",
    "x: !!binary aGVsbG8=",
    "a: &x 1\nb: *x",
    "[" * 100 + "]" * 100,
    "{a: " * 80 + "1" + "}" * 80,
    "a: b: c",
    "- - -",
    "'unclosed",
    "key: 'x'\nkey: 'y'",
    "!!set {a, b}",
    "!!omap [a: 1]",
    "!custom 3",
    "extends: /dev/zero",
    "extends: .",
    "extends: spec.yaml",
    "extends: missing.yaml",
    "extends: [a, b]",
    "name: &n x\nalias: *n",
    "lol: &l [l, l, l, l, l, l, l, l]\nlol2: &m [*l, *l, *l, *l, *l, *l, *l, *l]\n"
    "lol3: [*m, *m, *m, *m, *m, *m, *m, *m]",
]


def _paths(data: dict, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _paths(value, prefix + (key,))
        else:
            out.append(prefix + (key,))
    return out


@st.composite
def mutated(draw, bases: dict[str, dict], extra_keys: list[str]) -> str:
    """A base document with a few fields replaced, removed or added, as YAML, then maybe mangled."""
    import copy

    data = copy.deepcopy(draw(st.sampled_from(list(bases.values()))))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(_paths(data) or [("name",)]))
        parent = data
        for key in path[:-1]:
            if not isinstance(parent.get(key), dict):
                parent[key] = {}
            parent = parent[key]
        how = draw(st.sampled_from(["value", "value", "delete", "add", "nest"]))
        if how == "value":
            parent[path[-1]] = draw(VALUES)
        elif how == "delete":
            parent.pop(path[-1], None)
        elif how == "add":
            parent[draw(st.one_of(WORDS, st.sampled_from(extra_keys)))] = draw(VALUES)
        else:
            parent[path[-1]] = {"nested": {"deeper": parent.get(path[-1])}}
    text = yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    if draw(st.booleans()):
        lines = text.splitlines()
        at = draw(st.integers(0, len(lines)))
        snippet = draw(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=30)))
        text = "\n".join(lines[:at] + [snippet] + lines[at:]) + "\n"
    return text


# -- spec files ------------------------------------------------------------------------------------

SPEC_KEYS = [
    "extends",
    "name",
    "architecture",
    "vocab_size",
    "d_model",
    "max_seq_len",
    "position",
    "embedding",
    "head",
    "encoder",
    "decoder",
    "tie_embeddings",
    "n_layers",
    "attention",
    "ffn",
    "norm",
    "layers",
    "overrides",
    "cross_attention",
    "dropout",
    "type",
    "n_heads",
    "n_kv_heads",
    "head_dim",
]


def _spec_commands(slow: bool) -> list[list[str]]:
    commands = [
        ["validate"],
        ["describe"],
        ["describe", "--json"],
        ["compare"],
        ["diff", "{spec}"],
        ["plan", "--gpus", "8"],
    ]
    return commands + ([["describe", "--plot", "plot.png"]] if slow else [])


def _fuzz_specs(capsys, hostile, in_tmp, data, slow: bool) -> None:
    text = data.draw(mutated(SPECS, SPEC_KEYS), "spec")
    path = in_tmp / "fuzzed.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    command = data.draw(st.sampled_from(_spec_commands(slow)), "command")
    argv = [command[0], path] + [a.format(spec=hostile["spec.yaml"]) for a in command[1:]]
    bounded_run(capsys, argv)


@settings(parent=profile(slow=False))
@given(data=st.data())
def test_hostile_spec_files(capsys, hostile, in_tmp, data):
    _fuzz_specs(capsys, hostile, in_tmp, data, slow=False)


@pytest.mark.slow
@settings(parent=profile(slow=True))
@given(data=st.data())
def test_hostile_spec_files_at_length(capsys, hostile, in_tmp, data):
    _fuzz_specs(capsys, hostile, in_tmp, data, slow=True)


# -- recipe files ----------------------------------------------------------------------------------

RECIPE_KEYS = [
    "model",
    "spec",
    "overrides",
    "data",
    "tokenizer",
    "optimizer",
    "schedule",
    "trainer",
    "sample",
    "task",
    "extends",
    "seq_len",
    "batch_size",
    "max_steps",
    "lr",
    "output_dir",
    "cache_dir",
    "seed",
    "precision",
    "strategy",
    "devices",
    "accelerator",
    "sources",
    "dataset",
    "path",
    "betas",
]


@pytest.fixture()
def no_training(monkeypatch):
    """Stop where training would begin: everything before the first step is what is fuzzed."""
    import yamlformer.recipes.training.run

    def reached(*args, **kwargs):
        raise SystemExit(0)  # the recipe, its data, tokenizer, model and run folder were all accepted

    monkeypatch.setattr(yamlformer.recipes.training.run, "run_trainer", reached)


def _recipe_base(hostile) -> dict:
    recipe = yaml.safe_load(hostile["recipe"].read_text())
    recipe["trainer"]["output_dir"] = "run"  # relative to the recipe: the case's own folder
    recipe["data"]["cache_dir"] = "cache"
    return recipe


def _fuzz_recipes(capsys, hostile, in_tmp, data) -> None:
    text = data.draw(mutated({"recipe": _recipe_base(hostile)}, RECIPE_KEYS), "recipe")
    path = in_tmp / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    extra = data.draw(
        st.lists(
            st.sampled_from(
                [
                    ["--fresh"],
                    ["--no-samples"],
                    ["--resume"],
                    ["--resume", hostile["secret.txt"]],
                    ["--set", "trainer.max_steps=-1"],
                    ["--set", "model.spec=secret.txt"],
                    ["--set", "data=3"],
                    ["--set", "optimizer.lr=.nan"],
                    ["--set", "extends=x.yaml"],
                    ["--set", "trainer.seed=true"],
                ]
            ),
            max_size=2,
        ),
        "options",
    )
    bounded_run(capsys, ["train", path, *[a for option in extra for a in option]])


@settings(parent=profile(slow=False))
@given(data=st.data())
def test_hostile_recipe_files(capsys, hostile, in_tmp, no_training, data):
    _fuzz_recipes(capsys, hostile, in_tmp, data)


@pytest.mark.slow
@settings(parent=profile(slow=True))
@given(data=st.data())
def test_hostile_recipe_files_at_length(capsys, hostile, in_tmp, no_training, data):
    _fuzz_recipes(capsys, hostile, in_tmp, data)


# -- argument lists --------------------------------------------------------------------------------

#: module names --plugin may take here (importing any name runs that module: never a random one;
#: nor one that registers blocks, which would stay registered for the rest of the suite)
PLUGINS = ["no_such_plugin_module", "", "builder", "yamlformer.commands", ".", "a..b", "1abc", "os.path.x"]
OPTION_VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "2",
            "3",
            "8",
            "64",
            "1e309",
            "nan",
            "inf",
            "-inf",
            "1.5",
            "0.5",
            "",
            " ",
            "0x10",
            "99999999999999999999999",
            "true",
            "cuda",
            "cuda:7",
            "cpu",
            "meta",
            "mps",
            "bogus",
            "fsdp",
            "ddp",
            "hybrid",
            "shard",
            "bf16",
            "fp8",
            "h100",
            "a100-80gb",
            "décodeur",
            "-",
            "--",
            "80GB",
            "1.5TB",
            "-5GB",
            "gpt2",
            "llama",
            "test",
            "valid",
            "out",
            "x.yaml",
        ]
    ),
    NUMBERS.map(str),
    WORDS,
)
SET_VALUES = st.one_of(
    st.sampled_from(
        [
            "decoder.n_layers=2",
            "decoder.n_layers=true",
            "decoder.n_layers=1e9",
            "d_model=1e30",
            "extends=spec.yaml",
            "=",
            "a.b.c=",
            "name",
            ".=1",
            "decoder..n_layers=2",
            "decoder=[1]",
            "vocab_size=!!python/object:os.system",
            "position={type: rope",
            "decoder.layers.0:2.ffn=3",
        ]
    ),
    st.builds(lambda k, v: f"{k}={v}", WORDS, WORDS),
)


#: argument types whose value is a path the command writes
OUTPUT_TYPES = ("output_folder", "output_file")


def _command_parsers() -> dict:
    from yamlformer.builder.cli import parser

    root = parser()
    sub = next(a for a in root._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


def _commands(slow: bool) -> list[str]:
    names = ["validate", "schema", "describe", "compare", "diff", "plan", "import-hf", "export-hf", "generate"]
    return names + (["eval"] if slow else [])


@st.composite
def command_line(draw, hostile: dict, slow: bool) -> list:
    parsers = _command_parsers()
    name = draw(st.sampled_from(_commands(slow)))
    sub = parsers[name]
    paths = st.sampled_from(sorted(hostile.values(), key=str))
    argv: list = [name]
    positionals = [a for a in sub._actions if not a.option_strings]
    for action in positionals:
        if action.nargs == 0:
            continue
        good = {"checkpoint": hostile["checkpoint"], "source": hostile["checkpoint"], "folder": hostile["folder"]}
        value = good.get(action.dest, hostile["spec.yaml"])
        argv += draw(
            st.lists(
                st.one_of(st.just(value), paths, WORDS), min_size=1, max_size=3 if action.nargs in ("+", "*") else 1
            )
        )
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    for action in draw(st.lists(st.sampled_from(options), max_size=4)) if options else []:
        flag = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(flag)
        elif action.dest == "plugins" or flag == "--plugin":
            argv += [flag, draw(st.sampled_from(PLUGINS))]
        elif flag == "--set":
            argv += [flag, draw(SET_VALUES)]
        elif (flag == "--plot" and not slow) or flag == "--calibrate":  # --calibrate measures this machine
            continue  # for seconds (tests/test_calibration.py runs it)
        elif action.dest in ("out", "output", "plot") or getattr(action.type, "__name__", "") in OUTPUT_TYPES:
            argv += [flag, draw(st.one_of(st.sampled_from(["out", "out/x", "fuzz-out"]), paths))]
        else:
            argv += [flag, draw(st.one_of(OPTION_VALUES, paths))]
    if draw(st.integers(0, 9)) == 0:  # a stray token
        argv.insert(
            draw(st.integers(1, len(argv))), draw(st.one_of(st.sampled_from(["--bogus", "-o", "--", "-"]), WORDS))
        )
    if name == "generate":  # a decode of any length the user asks is not a hang: keep it short
        argv += ["--max-new-tokens", "3"]
    if name == "eval":
        argv += ["--max-batches", "1"] if "--all" not in argv else []
    return argv


def _fuzz_arguments(capsys, hostile, in_tmp, data, slow: bool) -> None:
    argv = data.draw(command_line(hostile, slow), "argv")
    bounded_run(capsys, argv)


@settings(parent=profile(slow=False))
@given(data=st.data())
def test_hostile_command_lines(capsys, hostile, in_tmp, data):
    _fuzz_arguments(capsys, hostile, in_tmp, data, slow=False)


@pytest.mark.slow
@settings(parent=profile(slow=True))
@given(data=st.data())
def test_hostile_command_lines_at_length(capsys, hostile, in_tmp, data):
    _fuzz_arguments(capsys, hostile, in_tmp, data, slow=True)


def test_the_harness_fails_a_hang_and_an_internal_error(capsys, monkeypatch):
    """The bounds above are real: a command that hangs fails its case, and so does one that
    reaches the last-resort net."""
    import hostile_helpers

    import yamlformer.builder.cli.schema as schema

    monkeypatch.setattr(hostile_helpers, "SECONDS", 0.2)
    monkeypatch.setattr(schema, "run", lambda args: time.sleep(5))
    with pytest.raises(pytest.fail.Exception, match="ran more than 0.2 s"):
        bounded_run(capsys, ["schema"])
    monkeypatch.setattr(schema, "run", lambda args: {}["missing"])
    with pytest.raises(AssertionError, match="internal error"):
        bounded_run(capsys, ["schema"])


# -- what the fuzz found, kept as plain cases ------------------------------------------------------


def test_a_block_type_that_is_a_mapping(capsys, in_tmp):
    spec = dict(SPECS["llama"])
    spec["decoder"] = {**spec["decoder"], "attention": {"type": {"nested": "multi_head"}, "n_heads": 4}}
    (in_tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = cli(capsys, "validate", in_tmp / "spec.yaml")
    clean(result)
    assert result.status == 1 and "decoder.attention" in result.out, result.text


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("task", [], "task"),
        ("trainer.seed", 2**70, "trainer.seed"),
        ("trainer.seed", -1, "trainer.seed"),
        ("trainer.accelerator", "tpu9", "trainer.accelerator"),
    ],
)
def test_recipe_values_the_fuzz_found(capsys, hostile, in_tmp, no_training, field, value, needle):
    recipe = _recipe_base(hostile)
    section, _, key = field.rpartition(".")
    (recipe[section] if section else recipe)[key] = value
    (in_tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli(capsys, "train", in_tmp / "recipe.yaml")
    clean(result)
    assert result.status == 1 and needle in result.text, result.text


def test_a_plugin_name_that_is_no_module_name(capsys):
    result = cli(capsys, "schema", "--plugin", ".")
    clean(result)
    assert result.status == 1 and "plugin '.' is not a module name" in result.text, result.text
