"""State-copy throughput of every available backend against the copy ceiling of the same device.

    .venv/bin/python bench/kernels.py [--json] [--repeats N] [--max-mib M] [--threads T]
                                      [--backends cuda,cpu]

For each available backend (``doctor`` availability) and each workload below, the states of
every Mamba layer of a public model are allocated on the backend's device, ``batch`` requests
move their whole state (every layer's conv and temporal block) from one block to another, and
the backend's ``hb_copy_state_blocks`` implementation is timed. The ceiling is one contiguous
``dst.copy_(src)`` of the same number of bytes on the same device, measured in the same run:
all state tensors are views into one buffer, and the ceiling copies its first half onto its
second. ``ratio`` = backend GB/s / ceiling GB/s; medians of ``--repeats`` runs, the backend
and the ceiling timed alternately.

Per-step volumes (state shapes and dtypes as vLLM allocates them; conv state = conv_kernel - 1
tokens, no speculative tokens; tensor parallel size 1):

- Qwen3.5-0.8B (``Qwen/Qwen3.5-0.8B`` text_config): 24 layers, ``full_attention_interval`` 4 ->
  18 gated-delta-net layers; ``linear_num_key_heads`` 16, ``linear_num_value_heads`` 16,
  ``linear_key_head_dim`` = ``linear_value_head_dim`` = 128, ``linear_conv_kernel_dim`` 4,
  ``dtype`` bfloat16. conv: (3, 2*16*128 + 16*128) bf16; recurrent: (16, 128, 128) in float32,
  the ``mamba_ssm_dtype`` Qwen3.5 configs set (vLLM's Qwen3.5 config hook applies it).
- Qwen3-Next-80B-A3B (``Qwen/Qwen3-Next-80B-A3B-Instruct``): 48 layers, interval 4 -> 36 GDN
  layers; key heads 16, value heads 32, head dims 128, conv kernel 4, bfloat16. conv:
  (3, 2*16*128 + 32*128) bf16; recurrent: (32, 128, 128) bf16 (no ``mamba_ssm_dtype``: vLLM's
  "auto" follows the model dtype).
- Nemotron-H-8B (``nvidia/Nemotron-H-8B-Base-8K``): 52 layers, ``hybrid_override_pattern`` with
  24 Mamba2 layers; ``mamba_num_heads`` 128, ``mamba_head_dim`` 64, ``n_groups`` 8,
  ``ssm_state_size`` 128, ``conv_kernel`` 4, bfloat16. conv: (3, 128*64 + 2*8*128) bf16; SSM:
  (128, 64, 128) float32 (vLLM's default ``mamba_ssm_cache_dtype`` for NemotronH).

Batches whose volume exceeds ``--max-mib`` are listed as skipped (the buffer is twice the
volume). ``--threads`` sets torch's CPU threads for the backend and the ceiling alike.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hybrid_backends import plugins
from vllm_hybrid_backends.types import DeviceKind, MambaStateTensor, StateKind


@dataclass(frozen=True)
class Workload:
    model: str
    layers: int
    conv: tuple[int, int]  # (state_len, dim), SD layout
    conv_dtype: torch.dtype
    temporal: tuple[int, ...]
    temporal_dtype: torch.dtype

    def bytes_per_request(self) -> int:
        conv = math.prod(self.conv) * self.conv_dtype.itemsize
        temporal = math.prod(self.temporal) * self.temporal_dtype.itemsize
        return self.layers * (conv + temporal)


WORKLOADS = [
    Workload("Qwen3.5-0.8B", 18, (3, 6144), torch.bfloat16, (16, 128, 128), torch.float32),
    Workload("Qwen3-Next-80B-A3B", 36, (3, 8192), torch.bfloat16, (32, 128, 128), torch.bfloat16),
    Workload("Nemotron-H-8B", 24, (3, 10240), torch.bfloat16, (128, 64, 128), torch.float32),
]
BATCHES = (1, 8, 64)
DEVICES = {DeviceKind.CPU: "cpu", DeviceKind.CUDA: "cuda", DeviceKind.ROCM: "cuda", DeviceKind.NPU: "npu"}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _median_seconds(runs: list[Callable[[], object]], device: torch.device,
                    repeats: int) -> list[float]:
    """Median time of each callable; they run alternately, so a load change on a shared
    machine affects them alike."""
    for run in runs:  # warm-up: first touch of the pages, kernel compilation
        run()
    _sync(device)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, samples in zip(runs, times):
            start = time.perf_counter()
            run()
            _sync(device)
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def _carve(arena: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A tensor of ``shape`` viewing ``arena`` bytes from ``offset`` (kept 256-byte aligned)."""
    nbytes = math.prod(shape) * dtype.itemsize
    view = arena[offset: offset + nbytes].view(dtype).view(shape)
    return view, offset + -(-nbytes // 256) * 256


def run_case(copy: Callable[..., object], workload: Workload, batch: int, device: torch.device,
             repeats: int, generator: torch.Generator) -> dict[str, object]:
    blocks = 2 * batch
    per_layer = [(workload.conv, workload.conv_dtype), (workload.temporal, workload.temporal_dtype)]
    padded = sum(-(-blocks * math.prod(s) * d.itemsize // 256) * 256 for s, d in per_layer)
    arena = torch.empty(padded * workload.layers, dtype=torch.uint8, device=device)
    states, offset = [], 0
    for layer in range(workload.layers):
        for (shape, dtype), kind in zip(per_layer, (StateKind.CONV_SD, StateKind.TEMPORAL)):
            tensor, offset = _carve(arena, offset, (blocks, *shape), dtype)
            states.append(MambaStateTensor(tensor, kind, 0, f"layers.{layer}.{kind.value}"))
    if device.type == "cpu":
        arena.random_(0, 256, generator=generator)
    else:
        arena.fill_(1)
    order = torch.randperm(blocks, generator=generator)
    src, dst = order[:batch].reshape(1, batch), order[batch:].reshape(1, batch)
    moved = workload.bytes_per_request() * batch
    half = arena.numel() // 2
    head, tail = arena[:moved], arena[half: half + moved]
    seconds, ceiling = _median_seconds(
        [lambda: copy(states=states, src_blocks=src, dst_blocks=dst), lambda: tail.copy_(head)],
        device, repeats,
    )
    gbps, ceiling_gbps = moved / seconds / 1e9, moved / ceiling / 1e9
    label = (f"{workload.model} x{batch} requests: {workload.layers} layers x "
             f"(conv {'x'.join(map(str, workload.conv))} {str(workload.conv_dtype)[6:]} + "
             f"state {'x'.join(map(str, workload.temporal))} {str(workload.temporal_dtype)[6:]})")
    return {"shape": label, "bytes": moved, "gbps": round(gbps, 3),
            "ceiling_gbps": round(ceiling_gbps, 3), "ratio": round(gbps / ceiling_gbps, 3)}


def available_backends() -> list[tuple[str, torch.device, Callable[..., object]]]:
    pm = plugins.get_plugin_manager()
    impls = {impl.plugin_name: impl.function for impl in pm.hook.hb_copy_state_blocks.get_hookimpls()}
    found = []
    for status in plugins.backend_statuses():
        if status.availability.available and status.name in impls:
            found.append((status.name, torch.device(DEVICES[status.identity.device_kind]),
                          impls[status.name]))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-mib", type=float, default=1536.0,
                        help="skip batches that move more than this (the buffer is twice as big)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend names to time (default: every available one)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error(f"--repeats and --threads must be >= 1, got {args.repeats}, {args.threads}")
    backends = available_backends()
    if args.backends is not None:
        wanted = [name.strip() for name in args.backends.split(",") if name.strip()]
        names = [name for name, _, _ in backends]
        unknown = [name for name in wanted if name not in names]
        if unknown or not wanted:
            parser.error(f"--backends {args.backends!r}: {', '.join(unknown) or 'no name'} not "
                         f"available here; available: {', '.join(names)}")
        backends = [entry for entry in backends if entry[0] in wanted]
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results: list[dict[str, object]] = []
    skipped: list[dict[str, Any]] = []
    devices: set[str] = set()
    for name, device, copy in backends:
        devices.add(str(device))
        for workload in WORKLOADS:
            for batch in BATCHES:
                moved = workload.bytes_per_request() * batch
                if moved > args.max_mib * 2**20:
                    skipped.append({"backend": name, "model": workload.model, "batch": batch,
                                    "bytes": moved, "reason": f"more than --max-mib {args.max_mib:g}"})
                    continue
                row = run_case(copy, workload, batch, device, args.repeats, generator)
                results.append({"backend": name, **row})
                if not args.json:
                    print(f"{name:6s} {row['shape']}\n       {moved / 2**20:9.1f} MiB  "
                          f"{row['gbps']:7.2f} GB/s  ceiling {row['ceiling_gbps']:7.2f} GB/s  "
                          f"ratio {row['ratio']:.2f}", flush=True)
    device_text = ", ".join(sorted(devices)) + f" ({args.threads} torch thread(s))"
    if args.json:
        print(json.dumps({"device": device_text, "repeats": args.repeats, "results": results,
                          "skipped": skipped}, indent=1))
    else:
        for skip in skipped:
            print(f"skipped: {skip['backend']} {skip['model']} x{skip['batch']} "
                  f"({skip['bytes'] / 2**20:.0f} MiB): {skip['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
