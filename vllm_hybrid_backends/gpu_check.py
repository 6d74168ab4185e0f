"""A GPU check anyone can run: ``python -m vllm_hybrid_backends.gpu_check [--json]``.

Needs only torch, triton and pluggy (no vLLM). On the visible CUDA/HIP GPU it runs:

1. parity: every state hook of the Triton backend against the reference, on fresh random states
   whose blocks the hook does not read are NaN-poisoned, compared bit for bit;
   with ``--fuzz N``, also N random layouts (groups, conv layouts, windows, widths, dtypes,
   moves) per copy hook;
2. sync: the per-step hooks (precopy, postprocess, checkpoint store, index gather) with their
   index tensors on the GPU under ``torch.cuda.set_sync_debug_mode("error")``: any host sync fails;
3. bandwidth: state copies (``hb_copy_state_blocks``, ``hb_precopy_running_states``) against a
   device-to-device ``copy_`` of the same bytes.

Without a GPU it prints one line and exits with status 2.

``--interior [--vllm-source DIR]`` checks instead the interior Mamba states of the device path
with vLLM's own GDN (FLA) and Mamba2 (SSD) Triton kernels (:mod:`.gpu_check_interior`): from the
installed vLLM, or from a copy of its kernel sources in ``DIR`` on a machine without vLLM
(:mod:`.vllm_source`; ``scripts/gpu_vllm_source.sh DIR`` makes one). Exit status 0 when every
check passes, 1 when one fails, 2 without a GPU, 3 (one line) when vLLM's kernels cannot be
loaded or that vLLM predates the check (0.32+: ``vllm_source.support_problem``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

NO_GPU_EXIT = 2
NO_KERNELS_EXIT = 3

try:
    import pluggy  # noqa: F401  (the backends' hook registry)
    import torch
except ImportError as missing:  # a machine without the requirements: one line, no traceback
    if __name__ != "__main__":
        raise
    print(f"gpu-check: {missing.name} is not installed for {sys.executable}; the check needs torch "
          "(a CUDA or ROCm build), triton and pluggy (`make gpu-check PYTHON=...` picks another "
          "interpreter)", file=sys.stderr)
    sys.exit(NO_GPU_EXIT)

from . import reference  # noqa: E402  (after the requirements check)
from .types import CheckpointBatch, MambaStateTensor, StateKind  # noqa: E402


def _triton_backend() -> Any:
    from .backends.triton import backend

    return backend.ROCM if torch.version.hip else backend.CUDA


def _states(gen: torch.Generator, device: str, dtype: torch.dtype, blocks: int,
            scale: int = 1) -> list[MambaStateTensor]:
    def make(*shape: int) -> torch.Tensor:
        return torch.randn(blocks, *shape, generator=gen).to(dtype).to(device)

    return [
        MambaStateTensor(make(4, 24 * scale), StateKind.CONV_SD, group=0, layer="conv_sd"),
        MambaStateTensor(make(24 * scale, 4), StateKind.CONV_DS, group=1, layer="conv_ds"),
        MambaStateTensor(make(4 * scale, 16, 16), StateKind.TEMPORAL, group=0, layer="ssm0"),
        MambaStateTensor(make(2 * scale, 16, 8), StateKind.TEMPORAL, group=1, layer="ssm1"),
    ]


def _clone(states: list[MambaStateTensor]) -> list[MambaStateTensor]:
    return [MambaStateTensor(s.tensor.clone(), s.kind, s.group, s.layer) for s in states]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(words), b.contiguous().view(words)))


def _poison(states: list[MambaStateTensor], keep: dict[int, torch.Tensor]) -> None:
    """NaN into every block but ``keep[group]``: blocks a hook must not read."""
    for state in states:
        mask = torch.ones(state.tensor.shape[0], dtype=torch.bool, device=state.tensor.device)
        mask[keep[state.group].to(state.tensor.device)] = False
        state.tensor[mask] = float("nan")


def _tables(gen: torch.Generator, rows: int, cols: int, blocks: int, device: str,
            groups: int = 2) -> list[torch.Tensor]:
    """Block tables, one per group, in which every request owns its blocks."""
    return [torch.randperm(blocks, generator=gen)[: rows * cols].view(rows, cols).to(device)
            for _ in range(groups)]


def parity_cases(device: str, seed: int = 0) -> dict[str, Callable[[Any], list[MambaStateTensor]]]:
    """Hook name -> ``run(impl)``; ``impl`` is a backend (hook methods) or the reference module.
    Each case builds the same inputs from ``seed``, so two runs see identical states."""

    def build(dtype: torch.dtype) -> tuple[torch.Generator, list[MambaStateTensor]]:
        gen = torch.Generator().manual_seed(seed)
        return gen, _states(gen, device, dtype, 48)

    def copy(impl: Any) -> list[MambaStateTensor]:
        _, states = build(torch.float32)
        src, dst = torch.tensor([[0, 1, 2, 5], [3, 4, 7, 8]]), torch.tensor([[1, 2, 9, 6], [4, 3, 10, 11]])
        _poison(states, {0: src[0], 1: src[1]})  # a chain 0->1->2 and a cycle 3<->4
        impl.hb_copy_state_blocks(states=states, src_blocks=src, dst_blocks=dst)
        return states

    def precopy(impl: Any) -> list[MambaStateTensor]:
        gen, states = build(torch.bfloat16)
        tables = _tables(gen, 6, 6, 48, device)
        _poison(states, {g: tables[g].flatten() for g in (0, 1)})
        src = torch.tensor([0, 1, 2, -1, 3, 2], device=device)
        dst = torch.tensor([1, 1, 2, 0, 4, 3], device=device)
        bias = torch.tensor([1, 2, 0, 0, 3, 1], device=device)
        impl.hb_precopy_running_states(states=states, block_tables=tables, src_cols=src,
                                       dst_cols=dst, token_bias=bias)
        return states

    def postprocess(impl: Any) -> list[MambaStateTensor]:
        gen, states = build(torch.float16)
        tables = _tables(gen, 5, 6, 48, device)
        _poison(states, {g: tables[g].flatten() for g in (0, 1)})
        out = torch.full((5,), 7, device=device)
        impl.hb_postprocess_accepted_states(
            states=states, block_tables=tables, running_cols=torch.tensor([1, 1, 0, 2, 1], device=device),
            num_running_tokens=torch.tensor([6, 8, 3, 11, 5], device=device),
            num_accepted=torch.tensor([3, 1, 2, 2, 1], device=device), block_size=4, num_accepted_out=out)
        return [*states, MambaStateTensor(out[:, None], StateKind.TEMPORAL, layer="num_accepted_out")]

    def checkpoints(impl: Any) -> list[MambaStateTensor]:
        gen, states = build(torch.float32)
        sources = [torch.randn(12, 24, generator=gen).to(device), torch.randn(12, 24, generator=gen).to(device),
                   torch.randn(3, 4, 16, 16, generator=gen).to(device),
                   torch.randn(3, 2, 16, 8, generator=gen).to(device)]
        batch = CheckpointBatch(*(torch.tensor(v, device=device) for v in
                                  ([4, 12, 9], [0, 0, 5], [-1, 7, 8], [20, 21, 22], [0, 2, 1])))
        _poison(states, {g: batch.initial_block[1:] for g in (0, 1)})
        impl.hb_store_checkpoints(states=states, sources=sources, checkpoints=batch)
        return states

    def gather(impl: Any) -> list[MambaStateTensor]:
        gen = torch.Generator().manual_seed(seed)
        tables = _tables(gen, 7, 5, 48, device)
        lens = torch.tensor([0, 1, 4, 5, 17, 20, 9], device=device)
        out = impl.hb_gather_aligned_state_indices(block_tables=tables, seq_lens=lens, block_size=4,
                                                   num_slots=2)
        return [MambaStateTensor(out, StateKind.TEMPORAL, layer="indices")]

    return {"hb_copy_state_blocks": copy, "hb_precopy_running_states": precopy,
            "hb_postprocess_accepted_states": postprocess, "hb_store_checkpoints": checkpoints,
            "hb_gather_aligned_state_indices": gather}


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fuzz_cases(device: str, seed: int) -> dict[str, Callable[[Any], list[MambaStateTensor]]]:
    """Like :func:`parity_cases`, for the three copy hooks, with a random layout drawn from
    ``seed``: 1-3 groups, each with a conv state (SD or DS, window 2-6, odd widths) and one or
    two temporal states of random shape, one dtype per case; random moves with chains, cycles
    and fan-out (copies), random columns and token biases (precopy, postprocess)."""
    draw = torch.Generator().manual_seed(seed)

    def pick(low: int, high: int) -> int:  # inclusive
        return int(torch.randint(low, high + 1, (1,), generator=draw))

    groups, blocks = pick(1, 3), 64
    dtype = _DTYPES[pick(0, 2)]
    specs: list[tuple[StateKind, tuple[int, ...], int]] = []
    window = pick(2, 6)  # every conv state shares it: a token bias must fit all of them
    for group in range(groups):
        dim = pick(1, 70) * 2 + 1
        conv = StateKind.CONV_SD if pick(0, 1) else StateKind.CONV_DS
        specs.append((conv, (window, dim) if conv is StateKind.CONV_SD else (dim, window), group))
        for _ in range(pick(1, 2)):
            specs.append((StateKind.TEMPORAL, tuple(pick(1, 17) for _ in range(pick(1, 3))), group))
    rows, width, block_size = pick(1, 9), pick(2, 6), pick(2, 6)

    def build() -> tuple[torch.Generator, list[MambaStateTensor]]:
        gen = torch.Generator().manual_seed(seed)
        states = [MambaStateTensor((torch.randn(blocks, *shape, generator=gen) * 4).to(dtype).to(device),
                                   kind, group, f"{kind.value}{i}")
                  for i, (kind, shape, group) in enumerate(specs)]
        return gen, states

    def copy(impl: Any) -> list[MambaStateTensor]:
        gen, states = build()
        src, dst = [], []
        count = int(torch.randint(1, 13, (1,), generator=gen))
        for _ in range(groups):
            order = torch.randperm(blocks, generator=gen).tolist()
            targets = order[:count]
            # sources: fresh blocks, other targets (chains, cycles) or one repeated (fan-out)
            pool = order[count: count + 6] + targets
            src.append([pool[int(torch.randint(len(pool), (1,), generator=gen))] for _ in targets])
            dst.append(targets)
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        _poison(states, {g: src_t[g] for g in range(groups)})
        impl.hb_copy_state_blocks(states=states, src_blocks=src_t, dst_blocks=dst_t)
        return states

    def precopy(impl: Any) -> list[MambaStateTensor]:
        gen, states = build()
        tabs = _tables(gen, rows, width, blocks, device, groups)
        _poison(states, {g: tabs[g].flatten() for g in range(groups)})
        src = torch.randint(-1, width - 1, (rows,), generator=gen)
        dst = (src + torch.randint(0, 2, (rows,), generator=gen)).clamp(0, width - 1)
        bias = torch.randint(0, window, (rows,), generator=gen)
        impl.hb_precopy_running_states(states=states, block_tables=tabs, src_cols=src.to(device),
                                       dst_cols=dst.to(device), token_bias=bias.to(device))
        return states

    def postprocess(impl: Any) -> list[MambaStateTensor]:
        gen, states = build()
        tabs = _tables(gen, rows, width, blocks, device, groups)
        _poison(states, {g: tabs[g].flatten() for g in range(groups)})
        running = torch.randint(1, block_size * (width - 1) + 1, (rows,), generator=gen)
        cols = ((running - 1) // block_size).clamp(max=width - 1)
        accepted = torch.randint(1, window, (rows,), generator=gen)  # bias < the window
        out = torch.full((rows,), 7, device=device)
        impl.hb_postprocess_accepted_states(
            states=states, block_tables=tabs, running_cols=cols.to(device),
            num_running_tokens=running.to(device), num_accepted=accepted.to(device),
            block_size=block_size, num_accepted_out=out)
        return [*states, MambaStateTensor(out[:, None], StateKind.TEMPORAL, layer="num_accepted_out")]

    return {"hb_copy_state_blocks": copy, "hb_precopy_running_states": precopy,
            "hb_postprocess_accepted_states": postprocess}


def check_fuzz(backend: Any, device: str, count: int, first_seed: int = 1000) -> dict[str, str]:
    """Hook -> ``"ok (N cases)"`` or the first seed whose result differs from the reference."""
    results = {}
    for hook in ("hb_copy_state_blocks", "hb_precopy_running_states",
                 "hb_postprocess_accepted_states"):
        results[hook] = f"ok ({count} cases)"
        for seed in range(first_seed, first_seed + count):
            case = fuzz_cases(device, seed)[hook]
            try:
                ours, theirs = case(backend), case(reference)
                bad = [s.layer for s, r in zip(ours, theirs) if not _same_bits(s.tensor, r.tensor)]
            except Exception as exc:  # a failure is a result of the check
                results[hook] = f"seed {seed}: error: {type(exc).__name__}: {exc}"
                break
            if bad:
                results[hook] = f"seed {seed}: differs in {', '.join(bad)}"
                break
    return results


def check_parity(backend: Any, device: str) -> dict[str, str]:
    """Hook -> ``"ok"`` or what differs from the reference."""
    results = {}
    for hook, case in parity_cases(device).items():
        try:
            ours, theirs = case(backend), case(reference)
            bad = [s.layer for s, r in zip(ours, theirs) if not _same_bits(s.tensor, r.tensor)]
            results[hook] = "ok" if not bad else f"differs in {', '.join(bad)}"
        except Exception as exc:  # a failure is a result of the check
            results[hook] = f"error: {type(exc).__name__}: {exc}"
    return results


def check_syncs(backend: Any, device: str) -> dict[str, str]:
    """Hook -> ``"ok"`` or the host sync it made, under ``set_sync_debug_mode("error")``."""
    cases = parity_cases(device)
    results = {}
    for hook in ("hb_precopy_running_states", "hb_postprocess_accepted_states",
                 "hb_store_checkpoints", "hb_gather_aligned_state_indices"):
        cases[hook](backend)  # compiles the kernels outside the checked region
        try:
            cases[hook](_SyncChecked(backend))
            results[hook] = "ok"
        except RuntimeError as exc:
            results[hook] = f"host sync: {str(exc).splitlines()[0]}"
    return results


class _SyncChecked:
    """The backend's hooks, each call run with host syncs made errors (the inputs are built,
    host-to-device copies included, before the check starts)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, hook: str) -> Callable[..., object]:
        call = getattr(self.backend, hook)

        def checked(**kwargs: Any) -> object:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return call(**kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return checked


def _time(run: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of ``run`` on the current stream (CUDA events)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def bandwidth(backend: Any, device: str, moves: int = 64, scale: int = 16) -> list[dict[str, Any]]:
    """State copies vs a device-to-device ``copy_`` of the same bytes (GB/s, read + write)."""
    gen = torch.Generator().manual_seed(1)
    states = _states(gen, device, torch.bfloat16, 2 * moves + 8, scale)
    block_bytes = {g: sum(s.tensor[0].numel() * s.tensor.element_size() for s in states if s.group == g)
                   for g in (0, 1)}
    nbytes = moves * sum(block_bytes.values())
    src = torch.arange(moves).repeat(2, 1)
    dst = src + moves
    tables = [torch.arange(2 * moves, device=device).view(moves, 2)] * 2
    cols = torch.zeros(moves, dtype=torch.long, device=device)
    flat = torch.empty(2, nbytes, dtype=torch.uint8, device=device)
    rows: list[dict[str, Any]] = []
    for name, run in (
        ("copy_(same bytes)", lambda: flat[1].copy_(flat[0])),
        ("hb_copy_state_blocks", lambda: backend.hb_copy_state_blocks(states=states, src_blocks=src,
                                                                      dst_blocks=dst)),
        ("hb_precopy_running_states", lambda: backend.hb_precopy_running_states(
            states=states, block_tables=tables, src_cols=cols, dst_cols=cols + 1, token_bias=cols)),
    ):
        seconds = _time(run)
        rows.append({"operation": name, "bytes": nbytes, "microseconds": round(seconds * 1e6, 1),
                     "gb_per_s": round(2 * nbytes / seconds / 1e9, 1)})
    ceiling = float(rows[0]["gb_per_s"])
    for row in rows:
        row["of_copy"] = round(row["gb_per_s"] / ceiling, 2)
    return rows


def run(as_json: bool, fuzz: int = 0) -> int:
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA/HIP GPU visible to torch {torch.__version__} "
              f"(CUDA build {torch.version.cuda}, HIP build {torch.version.hip}); "
              "run it on a machine with a GPU", file=sys.stderr)
        return NO_GPU_EXIT
    backend = _triton_backend()
    available = backend.hb_backend_probe()
    if not available.available:
        print(f"gpu-check: the {backend.NAME} Triton backend cannot run here: {available.reason}",
              file=sys.stderr)
        return NO_GPU_EXIT
    device = "cuda"
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backend": backend.NAME,
        "parity": check_parity(backend, device),
        "sync": check_syncs(backend, device),
        "fuzz": check_fuzz(backend, device, fuzz) if fuzz else {},
        "bandwidth": bandwidth(backend, device),
    }
    failed = [f"{part}:{hook}" for part in ("parity", "sync") for hook, result in report[part].items()
              if result != "ok"]
    failed += [f"fuzz:{hook}" for hook, result in report["fuzz"].items() if not result.startswith("ok")]
    report["ok"] = not failed
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"device {report['device']}, torch {report['torch']}, backend {report['backend']}")
        print(f"{'hook':34} {'parity':12} sync")
        for hook, result in report["parity"].items():
            print(f"{hook:34} {result:12} {report['sync'].get(hook, '-')}")
        for hook, result in report["fuzz"].items():
            print(f"{hook:34} random layouts: {result}")
        print(f"\n{'operation':28} {'bytes':>10} {'us':>9} {'GB/s':>8} {'of copy_':>9}")
        for row in report["bandwidth"]:
            print(f"{row['operation']:28} {row['bytes']:>10} {row['microseconds']:>9} "
                  f"{row['gb_per_s']:>8} {row['of_copy']:>9}")
        print("\nOK" if not failed else f"\nFAILED: {', '.join(failed)}")
    return 0 if not failed else 1


def run_interior(as_json: bool, vllm_source: str | None, device: str = "cuda") -> int:
    """``--interior``: :mod:`.gpu_check_interior`'s table; ``device="cpu"`` runs it under the
    Triton interpreter (``TRITON_INTERPRET=1`` set before the process started; tests)."""
    from . import vllm_source as source

    try:
        if vllm_source is not None:
            vllm_source = source.check_tree(vllm_source)
        elif (root := source.installed_root()) is not None and (problem := source.support_problem(root)):
            raise source.VllmSourceError(f"the installed vLLM ({os.path.join(root, 'vllm')}) {problem}; "
                                         "pass --vllm-source DIR with a vLLM 0.32+ tree")
    except source.VllmSourceError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return NO_KERNELS_EXIT
    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA/HIP GPU visible to torch {torch.__version__} "
              f"(CUDA build {torch.version.cuda}, HIP build {torch.version.hip}); "
              "run it on a machine with a GPU", file=sys.stderr)
        return NO_GPU_EXIT
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu-check: --device cpu runs the kernels under the Triton interpreter: set "
              "TRITON_INTERPRET=1 before starting Python", file=sys.stderr)
        return NO_GPU_EXIT
    from . import gpu_check_interior as interior

    try:
        kernels = interior.load_kernels(vllm_source, interpret=device == "cpu")
        backend, results = interior.run_checks(kernels, device)
    except source.VllmSourceError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return NO_KERNELS_EXIT
    failed = [r.check for r in results if not r.ok]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    if as_json:
        print(json.dumps({"device": name, "torch": torch.__version__, "backend": backend,
                          "vllm": kernels.source, "vllm_version": _vllm_version(),
                          "interior": [r.to_json() for r in results], "ok": not failed}, indent=2))
    else:
        print(f"device {name}, torch {torch.__version__}, backend {backend}, "
              f"vLLM {_vllm_version()} kernels from {kernels.source}")
        print("\n".join(interior.report(results)))
        print("\nOK" if not failed else f"\nFAILED: {', '.join(failed)}")
    return 0 if not failed else 1


def _vllm_version() -> str | None:
    from .compat import installed_vllm_version

    return installed_vllm_version()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_hybrid_backends.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fuzz", type=int, default=0, metavar="N",
                        help="also N random layouts per copy hook against the reference")
    parser.add_argument("--interior", action="store_true",
                        help="check the interior GDN / Mamba2 states with vLLM's own kernels instead")
    parser.add_argument("--vllm-source", metavar="DIR",
                        help="with --interior: load vLLM's kernels from DIR/vllm (no vLLM installed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help=argparse.SUPPRESS)  # cpu: under TRITON_INTERPRET=1 (tests)
    args = parser.parse_args(argv)
    if (args.vllm_source or args.device != "cuda") and not args.interior:
        parser.error("--vllm-source and --device go with --interior")
    if args.interior:
        return run_interior(args.json, args.vllm_source, args.device)
    if args.fuzz < 0:
        parser.error(f"--fuzz must be >= 0, got {args.fuzz}")
    return run(args.json, args.fuzz)


if __name__ == "__main__":
    sys.exit(main())
