"""Host and device time per call of the Triton backend's copy hooks on a GPU.

    python bench/gpu_hook_times.py [--calls N] [--label TEXT]

For Qwen3.5-0.8B and Nemotron-H-8B state shapes (see ``bench/kernels.py``) and 1, 8 and 64
requests: ``hb_copy_state_blocks`` and ``hb_precopy_running_states`` called on the backend and
through the plugin's facade, the precopy's move plan alone, and one ``copy_`` of the same bytes.
Per call: host time (``time.perf_counter`` over ``--calls`` calls, no sync between them), wall
time (with the final sync), device time and device ops (``torch.profiler``, 5 calls), and the
copy kernel's share of the device time. Needs a CUDA/HIP GPU, torch, triton and pluggy; no vLLM.
To compare two versions on one machine, run it once per checkout with ``PYTHONPATH`` pointing
at each and a ``--label``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _workloads() -> list[Any]:
    """Qwen3.5-0.8B's and Nemotron-H-8B's state shapes, from ``bench/kernels.py``."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return [w for w in module.WORKLOADS if w.model in ("Qwen3.5-0.8B", "Nemotron-H-8B")]


BATCHES = (1, 8, 64)


def measure(label: str, name: str, run: Callable[[], object], calls: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    device = sum(e.device_time_total for e in events) / 5
    kernel = sum(e.device_time_total for e in events if "state_copy" in e.key) / 5
    ops = sum(e.count for e in events) / 5
    print(f"{label:8s} {name:44s} host {host * 1e6:8.1f} us  wall {wall * 1e6:8.1f} us  "
          f"device {device:8.1f} us  copy kernel {kernel:8.1f} us  device ops {ops:4.0f}", flush=True)


def run_case(label: str, calls: int, backend: object, workload: Any, batch: int) -> None:
    from vllm_hybrid_backends import plugins
    from vllm_hybrid_backends.backends import plan
    from vllm_hybrid_backends.types import MambaStateTensor, StateKind

    model, layers, conv, conv_dtype = workload.model, workload.layers, workload.conv, workload.conv_dtype
    temporal, temporal_dtype = workload.temporal, workload.temporal_dtype
    device = torch.device("cuda")
    blocks = 2 * batch + 2
    states = []
    for layer in range(layers):
        states.append(MambaStateTensor(torch.ones(blocks, *conv, dtype=conv_dtype, device=device),
                                       StateKind.CONV_SD, 0, f"layers.{layer}.conv"))
        states.append(MambaStateTensor(torch.ones(blocks, *temporal, dtype=temporal_dtype, device=device),
                                       StateKind.TEMPORAL, 0, f"layers.{layer}.temporal"))
    order = torch.randperm(2 * batch)
    src, dst = order[:batch].view(1, batch), order[batch:].view(1, batch)
    flat = torch.empty(2, workload.bytes_per_request() * batch, dtype=torch.uint8, device=device)
    tables = [torch.arange(2 * batch, device=device).view(batch, 2)]
    cols = torch.zeros(batch, dtype=torch.long, device=device)
    next_cols, bias = cols + 1, torch.ones_like(cols)
    hooks: Any = backend
    case = f"{model} x{batch}"
    for name, run in (
        (f"copy_ {case}", lambda: flat[1].copy_(flat[0])),
        (f"hb_copy_state_blocks {case}",
         lambda: hooks.hb_copy_state_blocks(states=states, src_blocks=src, dst_blocks=dst)),
        (f"  facade copy {case}", lambda: plugins.copy_state_blocks(states, src, dst)),
        (f"hb_precopy_running_states {case}",
         lambda: hooks.hb_precopy_running_states(states=states, block_tables=tables, src_cols=cols,
                                                 dst_cols=next_cols, token_bias=bias)),
        (f"  facade precopy {case}",
         lambda: plugins.precopy_running_states(states, tables, cols, next_cols, bias)),
        (f"  precopy plan alone {case}", lambda: plan.precopy_moves(tables, cols, next_cols, bias)),
    ):
        measure(label, name, run, calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if not torch.cuda.is_available():
        print("gpu_hook_times: no CUDA/HIP GPU visible to torch; run it on a machine with one",
              file=sys.stderr)
        return 2
    from vllm_hybrid_backends.backends.triton.backend import CUDA, ROCM

    backend = ROCM if torch.version.hip else CUDA
    for workload in _workloads():
        for batch in BATCHES:
            run_case(args.label, args.calls, backend, workload, batch)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
