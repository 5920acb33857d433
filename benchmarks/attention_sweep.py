"""``benchmarks/attention.py --sweep``: every Triton attention kernel and launch config of this GPU's
generation timed at training and decode shapes, then our kernels (each at its fastest config)
against SDPA (its own choice of backend, and its flash and cuDNN backends alone) and FlexAttention,
under a time budget (``--budget``: 130 s by default, inside ``gpu_check``'s section; 280 s covers
every case on one H200), a table row printed as each is measured. Last, if time is left: what a
first training step pays to tune at a shape the table lacks (:func:`first_call`).

Cases (GPU, bf16): causal attention at head dims 128 and 64 (batch 4, seq 4096, 2048 wide: 16 heads
of 128 or 32 of 64), a 1024-token sliding window and packed documents (8 per row) at head dim 128,
forward and forward + backward; decode (batch 8, cache 16384, 32 query heads over 8 kv heads, head
dim 128) and the same decode through a static cache's token indices. ``--cpu``: the same plumbing
at tiny shapes under the Triton interpreter (the suite runs it).

Every case is first checked for correctness: each config's output (or gradients) against a
reference (SDPA here, eager on the CPU) before it is timed, and our end-to-end result again. The
rates: TFLOP/s of the visible (query, key) pairs, ``4 * B * H * pairs * D`` forward and 3.5 times
that forward + backward (the FlashAttention convention: causal attention counts half the pairs);
decode: GB/s of the K and V cache read once. The JSON (``--json PATH``) holds every row and the
``table`` (``chosen``: per kernel and shape key the fastest config; ``prefer``: per case the
faster of ours and SDPA) that ``--write-table`` merges into ``kernels/attention_tuning.yaml``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import warnings

import torch

TOLERANCE = 3e-2  # max |ours - reference| / max |reference|, bf16
PREFER_MARGIN = 1.05  # ours must be this much faster than SDPA for `auto` to prefer it
# `configs_from`: time only the configs that case found fastest (compiling every candidate for
# every case would not fit the budget); the rest time every candidate of this GPU's generation
GPU_CASES = {
    "causal-d128": dict(B=4, H=16, Hkv=16, S=4096, D=128, causal=True),
    "causal-d64": dict(B=4, H=32, Hkv=32, S=4096, D=64, causal=True),
    "decode-gqa": dict(B=8, H=32, Hkv=8, S=16384, D=128, Sq=1),
    "window-d128": dict(B=4, H=16, Hkv=16, S=4096, D=128, causal=True, window=1024, configs_from="causal-d128"),
    "documents-d128": dict(B=4, H=16, Hkv=16, S=4096, D=128, causal=True, documents=8, configs_from="causal-d128"),
    "decode-static": dict(B=8, H=32, Hkv=8, S=16384, D=128, Sq=1, causal=True, index=True, configs_from="decode-gqa"),
}
CPU_CASES = {
    "documents": dict(B=1, H=2, Hkv=1, S=24, D=16, causal=True, documents=3),
    "decode-static": dict(B=1, H=2, Hkv=1, S=24, D=16, Sq=1, causal=True, index=True),
}
COLUMNS = ("case", "section", "what", "config", "ms", "rate", "max_rel_err", "note")


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CaseTimeout` in this (main) thread after ``seconds``; a no-op off the main
    thread or where a caller's own interval timer is already running (its limit stands)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def timer(cpu: bool):
    """Milliseconds of one call: a ``do_bench`` median on the GPU, one timed call on the CPU."""
    if cpu:

        def once(fn):
            started = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - started)

        return once
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# ----------------------------------------------------------------------------------------------
# one case's inputs and reference
# ----------------------------------------------------------------------------------------------
def case_inputs(case: dict, device, dtype, seed: int = 0):
    """``(q, k, v, dout, kwargs)`` of a case; ``kwargs`` the options of its ``Mask``."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, S, D = (case[n] for n in ("B", "H", "Hkv", "S", "D"))
    Sq = case.get("Sq", S)
    q, k, v, dout = (
        torch.randn(shape, generator=g).to(device, dtype)
        for shape in ((B, H, Sq, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, H, Sq, D))
    )
    kwargs = {"causal": case.get("causal", False)}
    if "window" in case:
        kwargs["sliding_window"] = case["window"]
    if "documents" in case:  # random document boundaries, the same for every row
        cuts = torch.randperm(S - 1, generator=g)[: case["documents"] - 1] + 1
        kwargs["document_ids"] = (
            torch.zeros(B, S, dtype=torch.long)
            .index_add_(1, cuts, torch.ones(B, cuts.numel(), dtype=torch.long))
            .cumsum(1)
            .to(device)
        )
    if case.get("index"):  # a ring buffer of slots, wrapped: keys held out of order
        kwargs["token_index"] = (
            torch.arange(S - Sq, S, device=device),
            torch.arange(S, device=device).roll(S // 3),
        )
    return q, k, v, dout, kwargs


def visible_pairs(case: dict, kwargs: dict) -> float:
    """Query-key pairs the FLOP count charges: every pair, half of them when causal (the
    FlashAttention convention), or those a window or documents leave, counted."""
    B, S, Sq = case["B"], case["S"], case.get("Sq", case["S"])
    if "window" not in case and "documents" not in case:
        return B * Sq * S * (0.5 if case.get("causal") and Sq > 1 else 1.0)
    from yamlformer.kernels import Mask
    from yamlformer.kernels.attention import _visible, document_starts

    starts = document_starts(kwargs["document_ids"].cpu()) if "documents" in case else None
    keep, _ = _visible(Sq, S, Mask(causal=case.get("causal", False), sliding_window=case.get("window")), "cpu", starts)
    return float(keep.sum()) * (1 if starts is not None else B)


def reference(q, k, v, dout, kwargs, cpu: bool, train: bool):
    """``(out, dq, dk, dv)`` (no gradients for decode) from SDPA (eager on the CPU), fp32 out."""
    from yamlformer.kernels import Mask, attention

    leaves = [t.detach().clone().requires_grad_(train) for t in (q, k, v)]
    out = attention(*leaves, Mask(**kwargs), backend="eager" if cpu else "sdpa")
    if not train:
        return out.detach(), None, None, None
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


# ----------------------------------------------------------------------------------------------
# the configs of each kernel
# ----------------------------------------------------------------------------------------------
def kernel_runs(q, k, v, dout, kwargs, train: bool, expected):
    """``(call, {kernel: (launch(config), check())})``: each of this case's kernels launched alone
    with a given config on the case's inputs, and the max relative error of what it wrote."""
    from yamlformer.kernels import Mask, flash_launch, triton_attention
    from yamlformer.kernels.attention import document_starts

    starts = document_starts(kwargs["document_ids"]) if "document_ids" in kwargs else None
    mask = Mask(
        causal=kwargs["causal"], sliding_window=kwargs.get("sliding_window"), token_index=kwargs.get("token_index")
    )
    call = flash_launch.prepare(q, k, v, mask, q.shape[-1] ** -0.5, starts)
    out, lse = triton_attention._forward_outputs(q, v)
    ref_out, ref_dq, ref_dk, ref_dv = expected
    if not train:
        return call, {"decode": (lambda c: flash_launch.decode(call, out, lse, c), lambda: rel_err(out, ref_out))}
    dq, dk, dv = triton_attention._gradient_outputs(q, k, v)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    no_dbias = torch.empty(0, device=q.device)
    return call, {
        "fwd": (lambda c: flash_launch.forward(call, out, lse, c), lambda: rel_err(out, ref_out)),
        "dq": (lambda c: flash_launch.backward_dq(call, dout, out, lse, delta, dq, c), lambda: rel_err(dq, ref_dq)),
        "dkdv": (
            lambda c: flash_launch.backward_dkdv(call, dout, lse, delta, dk, dv, no_dbias, c),
            lambda: max(rel_err(dk, ref_dk), rel_err(dv, ref_dv)),
        ),
    }


def config_rows(name, call, runs, candidates, cpu, report, failed) -> dict:
    """Time every candidate of every kernel (in the order the backward needs: fwd, dq, dkdv);
    returns ``{kernel: (best config, its key)}``."""
    from yamlformer.kernels import flash_launch

    time_ms, best = timer(cpu), {}
    if not cpu:  # compile every config of every kernel side by side first
        from yamlformer.kernels import tuning

        jobs = [(kernel, config) for kernel in runs for config in candidates(kernel)]
        tuning.precompile(jobs, lambda job: runs[job[0]][0](job[1]))
        torch.cuda.synchronize()
    for kernel, (launch, check) in runs.items():
        for config in candidates(kernel):
            row = {"case": name, "section": "config", "what": kernel, "config": config, "key": call.key(kernel)}
            if not cpu and not flash_launch.eligible(kernel, call, config):
                report({**row, "note": "not eligible here (shared memory, tile taller than the queries)"})
                continue
            try:
                launch(config)
                if not cpu:
                    torch.cuda.synchronize()
                err = check()
                row.update(max_rel_err=err, ok=err < TOLERANCE)
                if row["ok"]:
                    row["ms"] = time_ms(lambda config=config: launch(config))
            except CaseTimeout:
                raise
            except Exception as exc:  # a config this GPU or Triton cannot build or run: recorded, skipped
                row.update(ok=False, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                failed.setdefault(kernel, []).append(config)
            report(row)
            if row.get("ok") and row.get("ms") is not None and (kernel not in best or row["ms"] < best[kernel][2]):
                best[kernel] = (config, row["key"], row["ms"])
        if kernel not in best:
            raise RuntimeError(f"no config of the {kernel} kernel ran correctly on case {name}")
        launch(best[kernel][0])  # leave its outputs for the next kernel (dq needs lse, dkdv delta)
    return {kernel: (config, key) for kernel, (config, key, _) in best.items()}


# ----------------------------------------------------------------------------------------------
# our kernels against SDPA and FlexAttention
# ----------------------------------------------------------------------------------------------
def sdpa_backend(name):
    """A callable running SDPA restricted to one backend (``flash`` or ``cudnn``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, causal):
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    return run


def flex_backend(q, kwargs, cpu: bool):
    """FlexAttention with this case's mask (causal, window, documents), compiled on the GPU; None
    for masks we take that it does not (token indices)."""
    if "token_index" in kwargs:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    causal, window, ids = kwargs["causal"], kwargs.get("sliding_window"), kwargs.get("document_ids")

    def keep(b, h, q_idx, kv_idx):  # the training cases' queries and keys are the same positions
        ok = (q_idx >= kv_idx) if causal else (q_idx >= 0)
        if window is not None:
            ok = ok & (q_idx - kv_idx < window)
        if ids is not None:
            ok = ok & (ids[b, q_idx] == ids[b, kv_idx])
        return ok

    B, _, Sq, _ = q.shape
    mask = create_block_mask(keep, B if ids is not None else None, None, Sq, Sq, device=q.device)
    if not cpu:
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def eager(q, k, v):  # the CPU's plumbing: its unfused reference implementation, warning silenced
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    return eager


def backends(q, kwargs, cpu: bool, ours_configs: dict) -> dict:
    """name -> fn(q, k, v): ours (at the sweep's configs), SDPA (its choice), SDPA's flash and
    cuDNN alone (where no mask tensor is needed), FlexAttention (where it takes the mask)."""
    from yamlformer.kernels import Mask, attention, tuning

    def ours(q, k, v):
        with tuning.forced(**ours_configs):
            return attention(q, k, v, Mask(**kwargs), backend="triton")

    fns = {"ours": ours, "sdpa": lambda q, k, v: attention(q, k, v, Mask(**kwargs), backend="sdpa")}
    unmasked = set(kwargs) == {"causal"}
    if unmasked and not cpu:
        for name in ("flash", "cudnn"):
            fns[f"sdpa-{name}"] = lambda q, k, v, run=sdpa_backend(name): run(q, k, v, kwargs["causal"])
    if not unmasked and "token_index" not in kwargs and q.shape[2] > 1:  # the masks only it and we take
        fns["flex"] = flex_backend(q, kwargs, cpu)
    return fns


def compare_rows(name, case, inputs, expected, ours_configs, cpu, report) -> dict:
    """Each backend's forward (and forward + backward) on the case; returns name -> its ms."""
    q, k, v, dout, kwargs = inputs
    train = case.get("Sq", case["S"]) > 16
    pairs = visible_pairs(case, kwargs) * case["H"]
    time_ms, results = timer(cpu), {}
    for backend, fn in backends(q, kwargs, cpu, ours_configs).items():
        row = {"case": name, "section": "compare", "what": backend}
        try:
            err = rel_err(fn(q, k, v), expected[0])
            row.update(max_rel_err=err, ok=err < TOLERANCE)
            row["ms"] = time_ms(lambda: fn(q, k, v))
            if train and not (cpu and backend == "flex"):  # FlexAttention has no backward on the CPU
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                row["ms_fwd_bwd"] = time_ms(lambda: fn(*leaves).backward(dout))
                row["rate"] = 4 * pairs * case["D"] / row["ms"] * 1e-9  # TFLOP/s
                row["rate_fwd_bwd"] = 3.5 * 4 * pairs * case["D"] / row["ms_fwd_bwd"] * 1e-9
            else:
                row["rate"] = 2 * k.numel() * k.element_size() / row["ms"] * 1e-6  # GB/s of the cache
        except CaseTimeout:
            raise
        except Exception as exc:  # a backend that cannot run this case (a missing kernel, a mask it refuses)
            row.update(ok=False, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        report(row)
        if row.get("ok"):
            results[backend] = row.get("ms_fwd_bwd", row.get("ms"))
    return results


def run_case(name, case, cpu, candidates, report, failed) -> dict:
    from yamlformer.kernels import Mask, tuning

    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    q, k, v, dout, kwargs = case_inputs(case, device, dtype)
    train = case.get("Sq", case["S"]) > 16
    expected = reference(q, k, v, dout, kwargs, cpu, train)
    call, runs = kernel_runs(q, k, v, dout, kwargs, train, expected)
    best = config_rows(name, call, runs, candidates, cpu, report, failed)
    for kernel, (config, key) in best.items():
        report({"case": name, "section": "choice", "what": kernel, "config": config, "key": key})
    results = compare_rows(
        name, case, (q, k, v, dout, kwargs), expected, {k: c for k, (c, _) in best.items()}, cpu, report
    )
    if "ours" in results and "sdpa" in results:
        faster = "triton" if results["ours"] * PREFER_MARGIN < results["sdpa"] else "sdpa"
        key = tuning.case_key(q.shape, v.shape[-1], kwargs["causal"], Mask(**kwargs).present())
        report({"case": name, "section": "prefer", "what": faster, "key": key, "note": "ours vs sdpa"})
    return {kernel: config for kernel, (config, _) in best.items()}


# ----------------------------------------------------------------------------------------------
# the sweep
# ----------------------------------------------------------------------------------------------
def format_row(row: dict) -> str:
    def cell(name):
        value = row.get(name)
        if name == "rate" and value is not None and row.get("rate_fwd_bwd") is not None:
            return f"{value:.1f} / {row['rate_fwd_bwd']:.1f}"
        if name == "ms" and value is not None and row.get("ms_fwd_bwd") is not None:
            return f"{value:.3f} / {row['ms_fwd_bwd']:.3f}"
        if isinstance(value, float):
            return f"{value:.2e}" if name == "max_rel_err" else f"{value:.3f}" if name == "ms" else f"{value:.1f}"
        if name == "config" and value is None and row.get("key"):
            return row["key"]
        return "" if value is None else str(value)

    return "| " + " | ".join(cell(name) for name in COLUMNS) + " |"


def sweep(cpu: bool = False, budget_s: float = 130.0, cases: dict | None = None, log=print) -> list[dict]:
    """Every case (``cases``, default this device's) within ``budget_s`` seconds: each case gets
    its share of what is left as a time limit, so one hang costs only its rows. Returns the rows
    (:func:`table_from_rows` makes the table from them)."""
    from yamlformer.kernels import flash_launch, tuning

    if cpu:
        gen, candidates = "interpreter", lambda kernel: flash_launch.INTERPRET_CANDIDATES[kernel]
    else:
        gen = tuning.generation(torch.device("cuda"))
        candidates = lambda kernel: tuning.candidates(gen, kernel)
    cases = cases if cases is not None else (CPU_CASES if cpu else GPU_CASES)
    rows, failed, found = [], {}, {}  # found: case -> kernel -> its fastest config

    def report(row):
        rows.append(row)
        log(format_row(row))
        sys.stdout.flush()

    log(f"attention sweep: {'the Triton interpreter' if cpu else torch.cuda.get_device_name()} ({gen}), "
        f"budget {budget_s:.0f} s")  # fmt: skip
    log("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    started = time.perf_counter()
    weights = {name: (1.0 if case.get("Sq", case["S"]) > 16 else 0.5) / (2 if "configs_from" in case else 1)
               for name, case in cases.items()}  # fmt: skip
    for name, case in cases.items():
        remaining = budget_s - (time.perf_counter() - started)
        share = remaining * weights[name] / sum(weights[n] for n in list(cases)[list(cases).index(name) :])
        if remaining < 1.0:
            report({"case": name, "section": "skipped", "note": "the sweep's budget is spent"})
            continue
        source = found.get(case.get("configs_from"))
        pool = (lambda kernel, source=source: [source[kernel]]) if source else candidates
        try:
            with time_limit(share):
                found[name] = run_case(name, case, cpu, pool, report, failed)
        except CaseTimeout as exc:
            report({"case": name, "section": "stopped", "note": str(exc)})
        except Exception as exc:  # one broken case costs its rows only
            report(
                {"case": name, "section": "failed", "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            )
    if not cpu and budget_s - (time.perf_counter() - started) > 30:
        try:
            with time_limit(budget_s - (time.perf_counter() - started)):
                first_call(report)
        except Exception as exc:  # over the budget or failed: its row says so
            report({"case": "first-call", "section": "stopped", "note": f"{type(exc).__name__}: {str(exc)[:160]}"})
    for kernel, configs in failed.items():
        rows.append({"section": "failed-config", "what": kernel, "configs": configs})
    rows.append({"section": "summary", "generation": gen, "seconds": time.perf_counter() - started})
    log(f"sweep done in {time.perf_counter() - started:.0f} s")
    return rows


def first_call(report) -> None:
    """What a first training step pays where the table has no config for its shape: a forward
    and backward (causal, batch 2, 8 heads of 128, seq 2048, bf16) whose three kernels are tuned
    among the table's candidates into an empty disk cache, against the same call again."""
    import os
    import tempfile

    from yamlformer.kernels import Mask, attention, tuning

    q, k, v, dout, kwargs = case_inputs(dict(B=2, H=8, Hkv=8, S=2048, D=128, causal=True), "cuda", torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    saved, before = os.environ.get("XDG_CACHE_HOME"), tuning.stats()
    seconds = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache  # platformdirs' user cache: nothing tuned before
        tuning.forget()
        try:
            for _ in range(2):
                started = time.perf_counter()
                attention(*leaves, Mask(**kwargs), backend="triton").backward(dout)
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
        finally:
            os.environ.pop("XDG_CACHE_HOME") if saved is None else os.environ.update(XDG_CACHE_HOME=saved)
    after = tuning.stats()
    tuned, spent = after["tuned"] - before["tuned"], after["tuning_seconds"] - before["tuning_seconds"]
    note = f"{tuned} kernels tuned in {spent:.1f} s (compiles included); the same call again {1e3 * seconds[1]:.1f} ms"
    report({"case": "first-call", "section": "tuning", "what": "ours", "ms": 1e3 * seconds[0], "note": note,
            "tuned": tuned, "tuning_seconds": spent})  # fmt: skip


def table_from_rows(rows: list[dict]) -> dict:
    """``{"generation", "chosen": {kernel: {key: config}}, "prefer": {case: backend}, "failed":
    {kernel: [configs]}}`` from a sweep's rows."""
    summary = next(r for r in rows if r.get("section") == "summary")
    chosen, prefer, failed = {}, {}, {}
    for row in rows:
        if row.get("section") == "choice":
            chosen.setdefault(row["what"], {})[row["key"]] = row["config"]
        elif row.get("section") == "prefer":
            prefer[row["key"]] = row["what"]
        elif row.get("section") == "failed-config":
            failed[row["what"]] = row["configs"]
    return {"generation": summary["generation"], "chosen": chosen, "prefer": prefer, "failed": failed}
