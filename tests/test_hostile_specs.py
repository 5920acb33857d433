"""Spec loading against hostile files: what is not a regular file, too large, nested or aliased
without end, extends chains and loops, sizes no model has. Each is one located line (file, line
where there is one, the field), exit status 1, never a traceback, a hang or the CLI's last resort.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from hostile_helpers import REPO, cli, refused

from yamlformer.builder.spec.loader import SpecError, load_spec

TINY = """\
architecture: decoder-only
vocab_size: 256
d_model: 64
max_seq_len: 64
decoder:
  n_layers: 2
  attention: {n_heads: 4}
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def validate(capsys, *paths) -> str:
    """``builder validate`` on ``paths``: exit 1, the problems on stdout; returns them."""
    result = cli(capsys, "validate", *paths)
    refused(result, 1, lines=0) if result.err else None
    assert result.status == 1 and "Traceback" not in result.text and "internal error" not in result.text, result.text
    return result.out


# -- what is not a spec file -----------------------------------------------------------------------


def test_not_regular_files(capsys, tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # no writer: opening it for reading would block for ever
    out = validate(capsys, fifo, tmp_path, tmp_path / "missing.yaml")
    assert f"{fifo}: is a FIFO (named pipe), not a file" in out
    assert f"{tmp_path}: is a folder, not a file" in out
    assert f"{tmp_path / 'missing.yaml'}: no such file" in out


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_an_endless_device(capsys):
    assert "/dev/zero: is a character device, not a file" in validate(capsys, "/dev/zero")


def test_a_loop_of_symbolic_links(capsys, tmp_path):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    child = write(tmp_path, "child.yaml", "name: child\nextends: a.yaml\n")
    out = validate(capsys, tmp_path / "a.yaml", child)
    assert f"{tmp_path / 'a.yaml'}: a loop of symbolic links" in out
    assert f"{child}:2:10: extends: cannot read " in out and "a.yaml: a loop of symbolic links" in out


def test_a_loop_of_symbolic_links_given_itself(capsys, tmp_path):
    """The loop given on the command line is said as one at the path given (it read "no such file")."""
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "nothing.yaml")
    lines = validate(capsys, tmp_path / "a.yaml", tmp_path / "dangling.yaml").splitlines()
    assert lines[0] == f"{tmp_path / 'a.yaml'}: a loop of symbolic links", lines
    assert lines[1] == f"{tmp_path / 'dangling.yaml'}: a symbolic link to nothing (its target does not exist)", lines
    refused(cli(capsys, "describe", tmp_path / "a.yaml"), 1, "a.yaml: a loop of symbolic links")


def test_a_file_over_the_size_limit(capsys, tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.write("name: big\n")
        f.truncate(50 << 20)  # 50 MiB, sparse: refused from its size, before a byte is parsed
    assert f"{big}: 50 MiB, more than the 1 MiB a file of this kind may have" in validate(capsys, big)


def test_a_file_that_is_no_yaml_mapping_of_ours(capsys, tmp_path):
    listing = write(tmp_path, "list.yaml", "- a\n- b\n")
    scalar = write(tmp_path, "scalar.yaml", "just some words\non two lines\n")
    foreign = write(tmp_path, "compose.yaml", "services:\n  web: {image: nginx}\nvolumes: {}\n")
    empty = write(tmp_path, "empty.yaml", "# nothing\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00\x01")
    out = validate(capsys, listing, scalar, foreign, empty, binary)
    assert f"{listing}:1:1: a spec is a mapping of fields, not a list" in out
    assert f"{scalar}:1:1: a spec is a mapping of fields, not a single value" in out
    assert f"{foreign}:1:1: not a spec: none of its 2 top-level keys is a field of a spec (architecture, " in out
    assert f"{empty}:1:1: the file is empty" in out
    assert f"{binary}:2:1: not UTF-8 text" in out
    for text in ("just some words", "services", "nginx", "volumes"):
        assert text not in out


# -- nesting, aliases, chains ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["block", "flow", "mapping"])
def test_nesting_a_thousand_deep(capsys, tmp_path, shape):
    if shape == "block":
        text = "name: deep\nx:\n" + "".join("  " * i + "-\n" for i in range(1, 1001))
    elif shape == "flow":
        text = "name: deep\nx: " + "[" * 1000 + "]" * 1000 + "\n"
    else:
        text = "name: deep\n" + "".join("  " * i + f"k{i}:\n" for i in range(1000))
    spec = write(tmp_path, "deep.yaml", text)
    line = validate(capsys, spec).splitlines()[0]
    assert line.startswith(f"{spec}:") and "nested more than 64 levels deep" in line, line
    if shape == "mapping":  # the key where it stops is named, with the stated limit
        assert ": k0.k1.k2.k3." in line and ".k62" in line, line
        assert line.endswith(": nested more than 64 levels deep (the limit)"), line


def test_aliases_nesting_without_end(capsys, tmp_path):
    lines = ["name: deep", "a0: &a0 [x]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 200)]
    spec = write(tmp_path, "aliases.yaml", "\n".join(lines) + "\n")
    assert "nested more than 64 levels deep with aliases expanded" in validate(capsys, spec)


def test_billion_laughs(capsys, tmp_path):
    lines = ["name: lol", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    spec = write(tmp_path, "lol.yaml", "\n".join(lines) + "\n")
    assert "more than 20,000 YAML nodes with aliases expanded (an alias bomb?)" in validate(capsys, spec)


def test_an_alias_that_contains_itself(capsys, tmp_path):
    spec = write(tmp_path, "loop.yaml", "name: loop\na: &x\n  - *x\n")
    assert f"{spec}:2:4: a.0: an alias refers to a node that contains it" in validate(capsys, spec)


def test_too_many_nodes_while_parsing(capsys, tmp_path):
    spec = write(tmp_path, "many.yaml", "name: many\nx: [" + ", ".join(["1"] * 30_000) + "]\n")
    assert "more than 20,000 YAML nodes" in validate(capsys, spec)


def test_an_extends_chain_of_two_thousand_files(capsys, tmp_path):
    write(tmp_path, "s0.yaml", TINY)
    for i in range(1, 2000):
        write(tmp_path, f"s{i}.yaml", f"extends: s{i - 1}.yaml\nname: s{i}\n")
    out = validate(capsys, tmp_path / "s1999.yaml")
    assert out.splitlines()[0].endswith("extends: an extends chain of more than 64 files"), out
    assert load_spec(tmp_path / "s60.yaml").name == "s60"  # a long legal chain still loads


def test_an_extends_cycle_through_a_symbolic_link(capsys, tmp_path):
    write(tmp_path, "a.yaml", "extends: link.yaml\nname: a\n")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "a.yaml")
    out = validate(capsys, tmp_path / "a.yaml")
    assert "extends: extends cycle: " in out and out.count("\n") == 2, out


# -- sizes no model has ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new, field, line, message",
    [
        ("n_layers: 2", "n_layers: 1000000000", "decoder.n_layers", 6, "must be <= 10000, got 1000000000"),
        ("d_model: 64", f"d_model: {10**30}", "d_model", 3, "must be <= 1048576"),
        ("vocab_size: 256", "vocab_size: 100000000000", "vocab_size", 2, "must be <= 16777216"),
        ("max_seq_len: 64", "max_seq_len: 10000000000000", "max_seq_len", 4, "must be <= 1073741824"),
        ("{n_heads: 4}", "{n_heads: 4, head_dim: 99999999}", "decoder.attention.head_dim", 7, "must be <= 1048576"),
        (
            "{n_heads: 4}",
            "{n_heads: 4, sliding_window: 99999999999}",
            "decoder.attention.sliding_window",
            7,
            "must be <= 1073741824",
        ),
        ("n_layers: 2", "n_layers: " + "9" * 5000, "decoder.n_layers", 6, "an integer of 5,000 digits (at most 100)"),
    ],
)
def test_absurd_sizes_are_refused_where_written(tmp_path, old, new, field, line, message):
    spec = write(tmp_path, "spec.yaml", TINY.replace(old, new))
    with pytest.raises(SpecError) as caught:
        load_spec(spec)
    [problem] = caught.value.problems
    assert (problem.path, problem.line) == (field, line)
    assert message in problem.message


def test_every_size_in_the_json_schema_has_an_upper_bound():
    """Integers and numbers state their maximum and lists their length, so an editor flags an
    absurd size as the loader does (a new block's fields included)."""
    from yamlformer.builder.cli.schema import spec_json_schema

    unbounded = []

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and not {"maximum", "exclusiveMaximum"} & set(node):
                unbounded.append(path)
            if node.get("type") == "array" and "maxItems" not in node:
                unbounded.append(path)
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(spec_json_schema(), "#")
    assert not unbounded, unbounded


def test_a_ten_thousand_layer_stack_is_counted_per_group(tmp_path):
    """Costs that grow with layers are per group of identical layers: counting 10,000 layers with
    an override every other layer takes the time of counting two."""
    import time

    from yamlformer.builder.analysis.estimates import estimate

    spec = write(
        tmp_path,
        "deep.yaml",
        TINY.replace(
            "n_layers: 2",
            "n_layers: 10000\n  overrides: [{layers: '0::2', attention: {n_heads: 4, sliding_window: 8}}]",
        ),
    )
    spec = load_spec(spec)
    start = time.process_time()
    est = estimate(spec, seq_len=64)
    assert time.process_time() - start < 2.0
    two = estimate(load_spec(write(tmp_path, "two.yaml", TINY)), seq_len=64)
    layer = two.params.by_component["decoder.attention"] // 2
    assert est.params.by_component["decoder.attention"] == 10000 * layer
    assert len(est.layers) == 10000 and est.layers[-1].index == 9999
    groups = spec.decoder.layer_groups()
    assert [len(indices) for indices, _ in groups] == [5000, 5000]
    assert spec.decoder.layer(3) is not spec.decoder.layer(4) and spec.decoder.layer(3).attention.sliding_window is None


def test_compare_refuses_what_it_cannot_build_at_once(capsys, tmp_path):
    spec = write(tmp_path, "deep.yaml", TINY.replace("n_layers: 2", "n_layers: 10000"))
    refused(
        cli(capsys, "compare", spec),
        1,
        "layers have 100,000 parameter tensors, more than the 50,000 compare builds",
        "`builder describe` counts it",
    )


def test_a_syntax_error_is_located(capsys, tmp_path):
    spec = write(tmp_path, "bad.yaml", TINY + "  ffn: [unclosed\n")
    line = validate(capsys, spec).splitlines()[0]
    assert line.startswith(f"{spec}:") and "YAML syntax error" in line


def test_the_zoo_still_loads():
    for path in sorted((REPO / "specs").rglob("*.yaml")):
        load_spec(path)


def test_the_pure_python_parser_reads_the_same_and_keeps_the_limits(monkeypatch):
    """libyaml parses when PyYAML has it; without it the pure-Python parser gives the same located
    documents and the same limits (only slower)."""
    from yamlformer.builder.spec import source as yaml_source

    for path in sorted((REPO / "specs").rglob("*.yaml")) + sorted((REPO / "recipes").glob("*.yaml")):
        text = path.read_text()
        fast, slow = yaml_source.SpecLoader(text).read("f"), yaml_source.PySpecLoader(text).read("f")
        assert (fast.data, fast.keys, fast.values) == (slow.data, slow.keys, slow.values), path
    monkeypatch.setattr(yaml_source, "SpecLoader", yaml_source.PySpecLoader)
    with pytest.raises(SpecError, match="nested more than 64 levels deep"):
        yaml_source.parse_document(("x: " + "[" * 100 + "]" * 100).encode(), "f")
    with pytest.raises(SpecError, match="more than 20,000 YAML nodes"):
        yaml_source.parse_document(("x: [" + ", ".join(["1"] * 20_001) + "]").encode(), "f")
