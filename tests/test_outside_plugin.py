"""Blocks from outside the package (``tests/plugin_blocks``: a latent-cache attention and an
interleaved rotary position, registered through ``--plugin``) go through every ordinary command —
validate, describe, compare, schema, build, train, generate with a cache — with exact counts, and
the registry-walking tests cover them, all with no change to generic code.

Both run in child processes: a registered block stays in its process's registry.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import tiny_recipe

from yamlformer.builder.spec.loader import validate_file

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SPEC = """\
name: tiny-lowrank
architecture: decoder-only
vocab_size: 64
d_model: 32
max_seq_len: 32
position: {type: interleaved_rope, theta: 500.0}
decoder:
  n_layers: 3
  attention: {type: lowrank_kv, n_heads: 4, kv_rank: 12, head_dim: 6, rope_dim: 4, v_head_dim: 10}
  ffn: {type: glu, hidden_dim: 48}
  norm: {type: rmsnorm}
  overrides:
    - layers: [1]
      attention: {type: multi_head, n_heads: 4, n_kv_heads: 2}
    - layers: [2]
      attention: {kv_rank: 6}
"""
# by hand: embedding 64*32 and an untied head 32*64; attention: lowrank_kv (q 32*4*10, latent and
# rotary key 32*(12+4), kv_up 12*4*(6+10), out 4*10*32), multi_head (q, k, v, out: 3072), lowrank_kv
# with kv_rank 6 (1280 + 32*10 + 6*64 + 1280); glu 3*32*48 per layer; rmsnorm 2*32 per layer + 32
PARAMS = 2 * 64 * 32 + (3840 + 3072 + 3264) + 3 * 3 * 32 * 48 + 3 * 2 * 32 + 32
# per token, fp32: latent + rotary key (12 + 4), k and v (2 * 2 * 8), latent + rotary key (6 + 4)
KV_BYTES_PER_TOKEN = (16 + 32 + 10) * 4

CHILD = """
import json, sys, torch
from pathlib import Path
from yamlformer.builder.cli import main
spec_path, recipe_path, out = sys.argv[1:4]
plugin = ["--plugin", "plugin_blocks"]
result = {}
for command in (["validate", spec_path], ["compare", spec_path, "--json"], ["schema"],
                ["describe", spec_path, "--json", "--seq-len", "16", "--batch", "2", "--dtype", "fp32"]):
    sys.stdout = open(Path(out) / (command[0] + ".out"), "w")
    result[command[0]] = main(command + plugin)
    sys.stdout.close()
sys.stdout = sys.__stdout__

from yamlformer.builder import build_model, estimate, load_spec
spec = load_spec(spec_path)
torch.manual_seed(0)
model = build_model(spec).eval()
prompt = torch.randint(0, 64, (2, 5))
cached = model.generate(prompt, max_new_tokens=11)
result["cache_bytes"] = [model.last_cache_nbytes, estimate(spec, seq_len=16, batch=2, dtype="fp32").memory.kv_cache]
result["cached_equals_full"] = torch.equal(cached, model.generate(prompt, max_new_tokens=11, use_cache=False))

result["train"] = main(["train", recipe_path, "--no-samples"] + plugin)
ckpt = next(Path(recipe_path).parent.rglob("last.ckpt"))
result["checkpoint"] = str(ckpt)
state = torch.load(ckpt, map_location="cpu", weights_only=True)
result["optimizer_steps"] = sorted({int(v) for k, v in state["state_dict"].items() if k.endswith("optimizer_steps")})
result["global_step"] = state["global_step"]
from yamlformer.recipes.trained import load_trained
trained, tokenizer, meta = load_trained(ckpt)
ids = torch.tensor([tokenizer.encode("def f(")])
result["trained_cached_equals_full"] = torch.equal(trained.generate(ids, max_new_tokens=12),
                                                   trained.generate(ids, max_new_tokens=12, use_cache=False))
sys.stdout = open(Path(out) / "generate.out", "w")
result["generate"] = main(["generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]
                          + plugin)
sys.stdout.close()
sys.stdout = sys.__stdout__
print(json.dumps(result))
"""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(TESTS))


def test_plugin_blocks_go_through_every_command_with_exact_counts(tmp_path):
    spec = tmp_path / "lowrank.yaml"
    spec.write_text(SPEC)
    steps = 3
    recipe = tiny_recipe(
        tmp_path,
        model={"spec": str(spec)},
        trainer={
            "max_steps": steps,
            "val_check_interval": steps,
            "checkpoint_every_n_steps": steps,
            "log_every_n_steps": 1,
        },
    )
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(spec), str(recipe), str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert {k: result[k] for k in ("validate", "compare", "schema", "describe", "train", "generate")} == dict.fromkeys(
        ("validate", "compare", "schema", "describe", "train", "generate"), 0
    ), child.stderr[-3000:]

    compare = json.loads((out / "compare.out").read_text())
    assert compare["match"] and compare["estimated"] == compare["actual"] == PARAMS
    described = json.loads((out / "describe.out").read_text())
    assert described["params"]["total"] == PARAMS
    assert described["memory"]["kv_cache"] == 2 * 16 * KV_BYTES_PER_TOKEN
    assert [layer["description"].split()[0] for layer in described["layers"]] == ["lowrank_kv", "4h/2kv", "lowrank_kv"]
    schema = json.loads((out / "schema.out").read_text())
    assert {"LowRankKVConfig", "InterleavedRopeConfig"} <= set(schema["definitions"])

    assert result["cache_bytes"] == [2 * 16 * KV_BYTES_PER_TOKEN] * 2 and result["cached_equals_full"]
    assert result["global_step"] == steps and result["optimizer_steps"] == [steps]  # after_optimizer_step, each step
    assert result["trained_cached_equals_full"]
    assert (out / "generate.out").read_text().startswith("def ")

    # without the plugin: located problems and a one-line error, never a traceback
    problems = validate_file(spec)
    assert [(p.line, p.path) for p in problems] == [(6, "position.type"), (9, "decoder.attention.type")], problems
    assert "unknown type 'lowrank_kv'" in problems[1].message
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.trained import load_trained

    with pytest.raises(RecipeError, match="--plugin"):
        load_trained(result["checkpoint"])


@pytest.mark.slow  # a second pytest run (~25 s); the commands above cover the same blocks in the default run
def test_the_registry_walking_tests_cover_plugin_blocks_unedited(tmp_path):
    """...and the smallest complete block of blocks/README.md, copied from it, passes them too."""
    readme = (REPO / "blocks" / "README.md").read_text()
    example = re.search(r"```python\n(# mypackage/blocks.py.*?)```", readme, re.S).group(1)
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("")
    (tmp_path / "mypackage" / "blocks.py").write_text(example)
    files = ["tests/test_block_counts.py", "tests/test_contracts.py", "tests/test_blocks.py", "tests/test_layout.py"]
    env = dict(_env(), BUILDER_PLUGINS="plugin_blocks,mypackage.blocks")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-v",
            "-p",
            "no:cacheprovider",
            *files,
            "-k",
            "lowrank_kv or interleaved_rope or scalenorm",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    passed = re.findall(r"::(\w+)\[([^\]]*)\] PASSED", run.stdout)
    # counts and FLOPs (self-attention, causal and not; positions in a model), cache == recompute,
    # schema, build-run-backprop; lowrank_kv is no cross-attention (skipped, with its reason)
    for name, tests in {
        "lowrank_kv": {
            "test_attention",
            "test_attention_decodes_with_its_cache_as_full_recomputation",
            "test_param_shapes_are_what_the_block_builds",
            "test_every_block_joins_a_spec_and_the_json_schema",
            "test_every_registered_block_builds_runs_and_backpropagates",
        },
        "interleaved_rope": {
            "test_position",
            "test_attention_positions_decode_with_the_cache_as_full_recomputation",
            "test_every_block_joins_a_spec_and_the_json_schema",
            "test_every_registered_block_builds_runs_and_backpropagates",
        },
        "scalenorm": {
            "test_norm",
            "test_every_block_joins_a_spec_and_the_json_schema",
            "test_param_shapes_are_what_the_block_builds",
            "test_every_registered_block_builds_runs_and_backpropagates",
        },
    }.items():
        assert tests <= {test for test, case in passed if name in case}, (name, run.stdout[-2000:])
