"""No error message contains a line of a file that is not a spec (or recipe) of ours, however the
user pointed at it: as a spec or recipe on the command line, through ``extends:``, a recipe's
``model.spec:``, ``--set model.spec=...``, ``--resume``, eval's ``--data``, as a checkpoint, as a
Hugging Face ``config.json`` or as weights. Each such file here is a stand-in for
``/etc/shadow``: every line of it carries a marker that must never be printed. An error may name
the path, a key of ours and a type; it never quotes the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile_helpers import checkpoint, clean, cli  # noqa: F401  (checkpoint: a fixture)
from recipe_helpers import tiny_recipe

MARK = "S3CR3T"
#: secret files of several shapes: shadow-like text, YAML that is a mapping of someone else's
#: keys, a YAML list, JSON, INI and bytes that are no UTF-8
SECRETS = {
    "shadow": f"root:$6$salt${MARK}hash:19000:0:99999:7:::\ndaemon:*:{MARK}:0:99999:7:::\n",
    "foreign-yaml": f"{MARK}_user: admin\n{MARK}_password: hunter2-{MARK}\ndatabase:\n  host: {MARK}.internal\n",
    "yaml-list": f"- {MARK} one\n- {MARK} two\n",
    "yaml-broken": f"key: [{MARK} unclosed\n  other: {MARK}: value\n",
    "json": json.dumps({f"{MARK}_token": f"{MARK}-value", "nested": {"k": MARK}}) + "\n",
    "ini": f"[{MARK}]\npassword = {MARK}\n",
    "tabs": f"\tkey: {MARK}\n\t- {MARK}\n",
}
SECRET_BYTES = {"binary": f"{MARK}\n".encode() + b"\xff\xfe\x00" + f"{MARK}\n".encode()}

TINY_SPEC = """\
name: tiny
architecture: decoder-only
vocab_size: 256
d_model: 64
max_seq_len: 64
decoder:
  n_layers: 2
  attention: {n_heads: 4}
"""


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("secrets")
    paths = {}
    for name, text in SECRETS.items():
        paths[name] = folder / f"{name}.txt"
        paths[name].write_text(text)
    for name, data in SECRET_BYTES.items():
        paths[name] = folder / f"{name}.bin"
        paths[name].write_bytes(data)
    return paths


def no_leak(result) -> None:
    clean(result)
    assert result.status != 0, result.text
    assert MARK not in result.text, result.text
    assert "hunter2" not in result.text, result.text


@pytest.fixture(params=sorted([*SECRETS, *SECRET_BYTES]))
def secret(request, secrets) -> Path:
    return secrets[request.param]


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    path.write_text(TINY_SPEC)
    return path


# -- a secret given where a spec goes --------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "{secret}"],
        ["describe", "{secret}"],
        ["compare", "{secret}"],
        ["plan", "{secret}", "--gpus", "8"],
        ["diff", "{secret}", "{spec}"],
        ["diff", "{spec}", "{secret}"],
        ["validate", "{spec}", "--set", "extends={secret}"],
        ["export-hf", "{secret}", "-o", "{out}"],
        ["export-hf", "{spec}", "-o", "{out}", "--weights", "{secret}"],
        ["export-hf", "{spec}", "-o", "{out}", "--hf-config", "{secret}"],
        ["plan", "{spec}", "--gpus", "8", "--recipe", "{secret}"],
    ],
)
def test_a_secret_named_on_the_command_line(capsys, tmp_path, secret, spec_file, command):
    argv = [a.format(secret=secret, spec=spec_file, out=tmp_path / "out") for a in command]
    no_leak(cli(capsys, *argv))


@pytest.mark.parametrize("command", ["validate", "describe", "compare"])
def test_a_secret_as_the_parent_of_a_spec(capsys, tmp_path, secret, command):
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {secret}\nname: child\n")
    no_leak(cli(capsys, command, child))


def test_a_secret_as_a_parent_further_up_the_chain(capsys, tmp_path, secrets):
    (tmp_path / "middle.yaml").write_text(f"extends: {secrets['foreign-yaml']}\nd_model: 64\n")
    (tmp_path / "child.yaml").write_text("extends: middle.yaml\nname: child\n")
    no_leak(cli(capsys, "validate", tmp_path / "child.yaml"))


# -- recipes ---------------------------------------------------------------------------------------


def test_a_secret_as_a_recipe(capsys, secret):
    no_leak(cli(capsys, "train", secret))


def test_a_secret_as_a_recipes_model_spec(capsys, tmp_path, secret):
    recipe = tiny_recipe(tmp_path, model={"spec": str(secret)})
    no_leak(cli(capsys, "train", recipe))


def test_a_secret_set_as_a_recipes_model_spec(capsys, tmp_path, secret):
    recipe = tiny_recipe(tmp_path)
    no_leak(cli(capsys, "train", recipe, "--set", f"model.spec={secret}"))


def test_a_secret_as_the_checkpoint_to_resume(capsys, tmp_path, secret):
    recipe = tiny_recipe(tmp_path)
    no_leak(cli(capsys, "train", recipe, "--resume", secret))


# -- checkpoints and their commands ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_secret_as_a_checkpoint(capsys, secret, command):
    extra = ["--prompt", "x"] if command == "generate" else []
    no_leak(cli(capsys, command, secret, *extra))


def test_a_secret_as_a_checkpoint_to_export(capsys, tmp_path, secrets):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(secrets["shadow"].read_bytes())
    no_leak(cli(capsys, "export-hf", ckpt, "-o", tmp_path / "out"))


def test_eval_data_that_is_a_secret_binary(capsys, checkpoint, secrets):
    """A text file is eval's input by design; a file that is not text is refused without a line of it."""
    no_leak(cli(capsys, "eval", checkpoint, "--data", secrets["binary"]))


# -- Hugging Face folders --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shadow", "foreign-yaml", "json", "binary", "yaml-list"])
def test_a_secret_as_a_hugging_face_config(capsys, tmp_path, secrets, name):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(secrets[name].read_bytes())
    no_leak(cli(capsys, "import-hf", folder, "-o", tmp_path / "out"))


def test_a_hugging_face_config_with_secret_values(capsys, tmp_path):
    """Values of the wrong kind are named by their key; the value itself is not shown."""
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {
        "model_type": "gpt2",
        "n_embd": f"{MARK}",
        "n_layer": [MARK],
        "n_head": {MARK: 1},
        "vocab_size": 50,
        "n_positions": 16,
    }
    (folder / "config.json").write_text(json.dumps(config))
    no_leak(cli(capsys, "import-hf", folder, "-o", tmp_path / "out"))


def test_a_hugging_face_config_naming_a_secret_model_type(capsys, tmp_path):
    """model_type is shown only when it is shaped like a family name (a lower-case identifier)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": f"{MARK}-model", "architectures": [MARK]}))
    no_leak(cli(capsys, "import-hf", folder, "-o", tmp_path / "out"))


def test_the_message_still_names_the_file(capsys, secrets):
    """Not leaking is not saying nothing: the refusal names the path and what was expected."""
    result = cli(capsys, "validate", secrets["foreign-yaml"])
    no_leak(result)
    assert str(secrets["foreign-yaml"]) in result.text and "not a spec" in result.text, result.text
