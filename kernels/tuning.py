"""Launch configs for the Triton attention kernels: a shipped table per GPU generation, tuning only
among its candidates, the choice cached on disk between processes.

The table is ``attention_tuning.yaml`` beside this file (``YAMLFORMER_ATTENTION_TABLE`` names
another, for trying a sweep's table before shipping it). Per generation (``sm_80``: Ampere and Ada,
``sm_90``: Hopper and later) and per kernel (``fwd``, ``dkdv``, ``dq``, ``decode``) it holds

* ``candidates``: the few configs a shape is tuned among: block sizes (``BLOCK_M``, ``BLOCK_N``),
  ``num_warps``, ``num_stages``, ``TMA`` (tensor-descriptor loads, sm_90 only), ``WARP_SPEC``
  (warp specialization of the interior loop), and for ``decode`` ``waves`` (programs per
  multiprocessor the split-K grid aims at);
* ``chosen``: per shape key, the candidate ``benchmarks/attention.py --sweep`` measured fastest;
  a key found there costs no tuning at all;

and per generation ``prefer``: per attention case (:func:`case_key`), the backend ``auto`` takes
where the sweep measured it faster than the other (empty until a sweep has run on that GPU).

A shape key (:func:`shape_key`) buckets lengths to powers of two between 128 and 16,384
(:func:`length_bucket`), so a training run with variable-length batches or a decode loop with a
growing cache tunes a handful of times, not once per length. A key in neither the table nor the
disk cache is tuned: each candidate compiled and timed once on the real inputs, the fastest kept
in memory and in ``attention-tuning.json`` under the user cache folder (``platformdirs``, as the
data caches), keyed by the GPU's name, the Triton and torch versions and a digest of the kernels'
source, so a new kernel or library tunes afresh. ``YAMLFORMER_ATTENTION_TUNING=off`` takes the
first eligible candidate instead of timing. :func:`stats` counts the seconds spent tuning.

Nothing here imports Triton: :func:`preference_on` is read by ``attention``'s ``auto`` on every
CUDA call (this module is not imported on other devices).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import platformdirs
import torch
import yaml

TABLE_PATH = Path(__file__).with_name("attention_tuning.yaml")
TABLE_ENV = "YAMLFORMER_ATTENTION_TABLE"
TUNING_ENV = "YAMLFORMER_ATTENTION_TUNING"
CACHE_FILE = "attention-tuning.json"
KERNELS = ("fwd", "dkdv", "dq", "decode")
GENERATIONS = ("sm_80", "sm_90")
MIN_BUCKET, MAX_BUCKET = 128, 16384
KERNEL_SOURCES = (
    "flash_kernels.py",
    "flash_forward.py",
    "flash_decode.py",
    "flash_backward.py",
    "flash_backward_dq.py",
)

_forced: dict[str, dict] = {}
_chosen: dict[tuple, dict] = {}
_stats = {"tuned": 0, "tuning_seconds": 0.0, "from_table": 0, "from_disk": 0}


# ----------------------------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------------------------
def length_bucket(n: int) -> int:
    """The power of two at or above ``n``, clamped to [128, 16384]: the lengths a key tells apart."""
    return min(MAX_BUCKET, max(MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length()))


def shape_key(dtype, block_d: int, block_dv: int, causal: bool, ranged: bool, scored: bool, *lengths) -> str:
    """The tuning key of one launch: element type, head-dim tiles, what kind of masking (``ranged``:
    windows, chunks, documents or token indices; ``scored``: ALiBi, a bias or soft-capping) and the
    bucketed lengths (``lengths``: ints, each through :func:`length_bucket`)."""
    kind = "causal" if causal else "full"
    extras = "".join(flag for flag, on in (("+ranged", ranged), ("+scored", scored)) if on)
    sizes = "/".join(str(length_bucket(n)) for n in lengths)
    return f"{str(dtype).removeprefix('torch.')} d{block_d}/{block_dv} {kind}{extras} {sizes}"


def case_key(q_shape, v_head_dim: int, causal: bool, masks: dict, decode_rows: int = 16) -> str:
    """The ``prefer`` key of one attention call: ``decode`` (at most ``decode_rows`` queries) or
    ``train``, the masks present (``masks``: name -> present) or ``causal``/``full``, the head dim.
    ``train:causal:d128``, ``decode:causal+token_index:d128``."""
    phase = "decode" if q_shape[2] <= decode_rows else "train"
    names = (["causal"] if causal else []) + sorted(name for name, present in masks.items() if present)
    return f"{phase}:{'+'.join(names) or 'full'}:d{max(q_shape[3], v_head_dim)}"


# ----------------------------------------------------------------------------------------------
# the shipped table
# ----------------------------------------------------------------------------------------------
@functools.cache
def _load_table(path: str) -> dict:
    with open(path) as f:
        table = yaml.safe_load(f) or {}
    if not isinstance(table, dict):
        raise ValueError(f"{path}: the attention tuning table must be a mapping of GPU generations")
    return table


def table() -> dict:
    """The table in use: ``YAMLFORMER_ATTENTION_TABLE``'s file when set, else the shipped one."""
    return _load_table(os.environ.get(TABLE_ENV) or str(TABLE_PATH))


def family(capability: tuple[int, int]) -> str:
    """The table generation of a compute capability: ``sm_90`` from Hopper on, else ``sm_80``."""
    return "sm_90" if capability[0] >= 9 else "sm_80"


@functools.cache
def _device_facts(index: int) -> tuple[str, str, int, int]:
    # local: triton loads through flash_kernels first (the interpreter's set-up on a CPU); read here on a GPU
    import triton

    props = torch.cuda.get_device_properties(index)
    try:  # what Triton itself checks a launch's shared memory against
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    except Exception:  # another driver or Triton: the opt-in limit, or the generation's
        smem = getattr(props, "shared_memory_per_block_optin", 0) or {9: 227, 8: 163}.get(props.major, 99) * 1024
    return family((props.major, props.minor)), props.name, props.multi_processor_count, smem


def device_facts(device) -> tuple[str, str, int, int]:
    """``(generation, name, multiprocessors, shared memory per block)`` of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_facts(index)


def generation(device) -> str | None:
    """The table generation of a device: None off CUDA (or where this torch has none)."""
    return device_facts(device)[0] if device.type == "cuda" and torch.cuda.is_available() else None


def preference(gen: str | None, case: str) -> str | None:
    """The backend the table's ``prefer`` names for ``case`` on ``gen`` GPUs, or None."""
    return ((table().get(gen) or {}).get("prefer") or {}).get(case)


@torch.compiler.assume_constant_result
def preference_on(device_index: int, case: str) -> str | None:
    """:func:`preference` on CUDA device ``device_index`` (-1: the current one). A constant to
    ``torch.compile`` (read while tracing, never traced), so ``auto`` in a compiled model does not
    break its graph; this module is imported on CUDA only, where importing Dynamo costs nothing more."""
    device = torch.device("cuda") if device_index < 0 else torch.device("cuda", device_index)
    return preference(generation(device), case)


def candidates(gen: str, kernel: str) -> list[dict]:
    return list(((table().get(gen) or {}).get(kernel) or {}).get("candidates") or [])


# ----------------------------------------------------------------------------------------------
# choosing
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def forced(**configs):
    """Run the named kernels (``fwd=``, ``dkdv=``, ``dq=``, ``decode=``) with these configs, as
    the sweep times each one: no table, cache or tuning is consulted for them."""
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"forced: unknown kernels {sorted(unknown)}; expected some of {KERNELS}")
    saved = dict(_forced)
    _forced.update(configs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def forced_config(kernel: str) -> dict | None:
    return _forced.get(kernel)


def forget() -> None:
    """Drop the choices this process remembers (the table and the disk cache stay)."""
    _chosen.clear()


def stats() -> dict:
    """Keys tuned, seconds spent tuning, and keys taken from the table or the disk cache, in
    this process."""
    return dict(_stats)


def _bench(run) -> float:
    """Milliseconds one call of ``run`` takes (the median of a short ``do_bench``)."""
    # local: triton loads through flash_kernels first (the interpreter's set-up on a CPU); read here on a GPU
    import triton.testing

    return triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")


def choose(kernel: str, key: str, device, run, eligible=lambda config: True) -> dict:
    """The config ``kernel`` runs with for ``key`` on ``device``: forced, or remembered, or the
    table's ``chosen``, or the disk cache's, or the fastest eligible candidate timed now
    (``run(config)`` launches the kernel once with that config on the real inputs)."""
    if kernel in _forced:
        return _forced[kernel]
    gen, name, _, _ = device_facts(device)
    memo = (gen, name, kernel, key)
    if memo in _chosen:
        return _chosen[memo]
    entry = (table().get(gen) or {}).get(kernel) or {}
    pool = [c for c in entry.get("candidates") or [] if eligible(c)]
    if not pool:
        raise RuntimeError(
            f"no launch config of the {kernel!r} attention kernel fits this GPU ({name}, {gen}); "
            f"the table {os.environ.get(TABLE_ENV) or TABLE_PATH} lists {len(entry.get('candidates') or [])}"
        )
    shipped = (entry.get("chosen") or {}).get(key)
    if shipped is not None and eligible(shipped):
        _stats["from_table"] += 1
        _chosen[memo] = shipped
        return shipped
    cache = DiskCache()
    cached = cache.get(name, kernel, key)
    if cached in pool:
        _stats["from_disk"] += 1
        _chosen[memo] = cached
        return cached
    best = pool[0] if len(pool) == 1 or os.environ.get(TUNING_ENV, "").lower() == "off" else _tune(pool, run)
    _chosen[memo] = best
    cache.put(name, kernel, key, best)
    return best


def precompile(pool: list[dict], run) -> None:
    """Launch every config once, in threads, so that Triton compiles them side by side (its
    compiler leaves the GIL) before any is timed; failures are met again when timed."""

    def quietly(config):
        try:
            run(config)
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=max(1, min(len(pool), os.cpu_count() or 1, 8))) as threads:
        list(threads.map(quietly, pool))


def _tune(pool: list[dict], run) -> dict:
    started = time.perf_counter()
    precompile(pool, run)
    timings, failure = [], None
    for config in pool:
        try:
            timings.append((_bench(lambda config=config: run(config)), len(timings), config))
        except Exception as exc:  # a config this GPU or this Triton cannot build: the others compete
            failure = exc
    _stats["tuned"] += 1
    _stats["tuning_seconds"] += time.perf_counter() - started
    if not timings:
        raise RuntimeError(f"every launch config failed; the last error: {failure!r}") from failure
    return min(timings, key=lambda t: (t[0], t[1]))[2]


# ----------------------------------------------------------------------------------------------
# the disk cache
# ----------------------------------------------------------------------------------------------
@functools.cache
def fingerprint() -> str:
    """What a cached choice is only good for: the Triton and torch versions and the kernels' source."""
    # local: triton loads through flash_kernels first (the interpreter's set-up on a CPU); read here on a GPU
    import triton

    digest = hashlib.sha256()
    for source in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / source).read_bytes())
    return f"triton {triton.__version__}, torch {torch.__version__}, kernels {digest.hexdigest()[:16]}"


def cache_path() -> Path:
    return Path(platformdirs.user_cache_dir("builder", appauthor=False)) / CACHE_FILE


class DiskCache:
    """``attention-tuning.json``: ``{fingerprint: {gpu name: {kernel: {key: config}}}}``. Read on
    each miss (another process may have tuned since), written whole through a temporary file and a
    rename, so a reader never sees half a file; an unreadable file counts as empty."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_path()

    def _read(self) -> dict:
        """The file's mapping; anything else (missing, no regular file: a FIFO would block the
        read, not JSON, nested past the parser, another shape) counts as empty."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                return {}
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _within(data: dict, *keys: str) -> dict:
        """``data[k1][k2]...`` where each level is a mapping, else a new empty one (a hostile or
        damaged file's other shapes are dropped, not followed)."""
        for key in keys:
            data = data.get(key)
            if not isinstance(data, dict):
                return {}
        return data

    @staticmethod
    def _configs(choices: dict) -> dict:
        return {key: config for key, config in choices.items() if isinstance(config, dict)}

    def get(self, gpu: str, kernel: str, key: str) -> dict | None:
        found = self._within(self._read(), fingerprint(), gpu, kernel).get(key)
        return found if isinstance(found, dict) else None

    def put(self, gpu: str, kernel: str, key: str, config: dict) -> None:
        data = self._read()
        mine = {  # each GPU's kernels' choices that are mappings
            g: {k: self._configs(self._within(data, fingerprint(), g, k)) for k in kernels}
            for g, kernels in self._within(data, fingerprint()).items()
            if isinstance(kernels, dict)
        }
        data = {fingerprint(): mine}  # older fingerprints, and what is no mapping, are dropped
        data[fingerprint()].setdefault(gpu, {}).setdefault(kernel, {})[key] = config
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:  # a read-only home: the choice still holds for this process
            pass


def smem_bytes(config: dict, element_size: int, block_d: int, block_dv: int, tiles: tuple) -> int:
    """Shared memory a config's pipelined loop needs, estimated (within 2 KiB of what Triton 3.6
    and 3.9 allocate on sm_90): ``tiles`` is ``(resident, both, streamed)``: the ``"M"`` or ``"N"``
    rows held for the whole program (one key-wide tile, or a key-wide and a value-wide one when
    ``both``), and the rows of which ``num_stages`` key-wide plus value-wide tiles are in flight."""
    resident, both, streamed = tiles
    rows = {"M": config.get("BLOCK_M", 16), "N": config["BLOCK_N"]}
    stages = max(1, config.get("num_stages", 2))
    held = (block_d + block_dv if both else block_d) * rows[resident]
    return element_size * (held + stages * (block_d + block_dv) * rows[streamed]) + 2048


def decode_splits(seq_k: int, programs: int, multiprocessors: int, waves: float, block_n: int) -> tuple[int, int]:
    """``(splits, split length)`` of a decode launch: enough splits of the cache that the grid's
    ``programs * splits`` fills ``waves`` programs per multiprocessor, each split a whole number of
    ``block_n`` tiles and at least two of them, at most 256 splits."""
    target = max(1, math.ceil(waves * multiprocessors / max(1, programs)))
    split_len = max(2 * block_n, math.ceil(math.ceil(seq_k / target) / block_n) * block_n)
    splits = math.ceil(seq_k / split_len)
    if splits > 256:
        split_len = math.ceil(math.ceil(seq_k / 256) / block_n) * block_n
        splits = math.ceil(seq_k / split_len)
    return splits, split_len


# ----------------------------------------------------------------------------------------------
# writing the table (benchmarks/attention.py --sweep --write-table)
# ----------------------------------------------------------------------------------------------
def updated_table(current: dict, gen: str, chosen: dict, prefer: dict, failed: dict | None = None) -> dict:
    """``current`` with ``gen``'s ``chosen`` (kernel -> key -> config) and ``prefer`` (case ->
    backend) entries replaced by a sweep's; candidates that ``failed`` (kernel -> configs that did
    not build or run) and won nowhere are dropped, so users never tune among them."""
    table = json.loads(json.dumps(current))  # a deep copy of plain data
    entry = table.setdefault(gen, {})
    for kernel in KERNELS:
        section = entry.setdefault(kernel, {"candidates": [], "chosen": {}})
        section.setdefault("chosen", {}).update((chosen or {}).get(kernel, {}))
        winners = list(section["chosen"].values())
        broken = (failed or {}).get(kernel, [])
        section["candidates"] = [c for c in section.get("candidates") or [] if c not in broken or c in winners]
    entry.setdefault("prefer", {}).update(prefer or {})
    return table


def write_table(table: dict, path: Path | None = None) -> Path:
    """Write ``table`` as the shipped YAML (the header comment of the shipped file kept)."""

    class Plain(yaml.SafeDumper):  # one config chosen for several keys is written out each time
        def ignore_aliases(self, data):
            return True

    path = Path(path or TABLE_PATH)
    header = "".join(line for line in TABLE_PATH.read_text().splitlines(keepends=True) if line.startswith("#"))
    body = yaml.dump(table, Dumper=Plain, sort_keys=False, default_flow_style=None, width=100)
    path.write_text(header + body)
    _load_table.cache_clear()
    return path
