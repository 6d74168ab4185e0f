"""Scheduler step cost, plugin vs upstream, with both replays in lock-step.

    python bench/step_cost_lockstep.py --workload chat --rounds 3
    python bench/step_cost_lockstep.py --workload agentic --rounds 3 --json
    python bench/step_cost_lockstep.py --workload short --rounds 3 --upstream-twice

``replay --timing-repeats N`` alternates whole replays (tens of seconds each), so on a shared
host a change of load between two replays moves the ratio by more than the plugin costs. Here
the upstream and the plugin replay of one workload run in one process, one scheduler step of
each in turn, the plugin's engine patches swapped in for its steps only: both see the same
load, step by step. Timed as ``replay`` times a step (``schedule`` plus
``update_from_output``): per policy the median step, in wall-clock and in thread time (the
latter leaves out the time other processes held the core: the steadier one on a loaded host),
and the total thread time of those calls. A policy that keeps more requests running has
longer steps for that reason alone, so each policy's requests per step and median thread time
per scheduled request are reported too (``per_request_ratio``, ``requests_per_step_ratio``).
The deterministic results (prefill tokens computed, preemptions, state
mismatches, token hit rate, scheduler steps) must equal ``replay``'s, which the output repeats
for a check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

POLICIES = ("upstream", "plugin")


def _targets(policy: Any) -> list[tuple[Any, str]]:
    """(owner, attribute) of every symbol the policy's patches may replace."""
    from vllm_hybrid_backends.replay.policy import _resolve_owner

    found = []
    for module in policy.patch_modules():
        target = importlib.import_module(module.TARGET_MODULE)
        for symbol in module.TARGET_SYMBOLS:
            try:
                owners, attr = _resolve_owner(target, symbol)
            except AttributeError:  # a symbol of another vLLM version
                continue
            found += [(owner, attr) for owner in owners]
    return found


def _snapshot(targets: list[tuple[Any, str]]) -> list[tuple[Any, str, Any]]:
    from vllm_hybrid_backends.replay.policy import _MISSING

    return [(owner, attr, vars(owner).get(attr, _MISSING)) for owner, attr in targets]


def _restore(snapshot: list[tuple[Any, str, Any]]) -> None:
    from vllm_hybrid_backends.replay.policy import _MISSING

    for owner, attr, value in snapshot:
        if value is _MISSING:
            if attr in vars(owner):
                delattr(owner, attr)
        else:
            setattr(owner, attr, value)


def lockstep_round(workload: str, upstream_twice: bool = False) -> dict[str, Any]:
    """One upstream and one plugin replay of ``workload``, a scheduler step of each in turn;
    ``upstream_twice``: the plugin's slot replays upstream too (what the bench itself adds)."""
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator
    from vllm_hybrid_backends.replay import harness
    from vllm_hybrid_backends.replay.policy import get_policy
    from vllm_hybrid_backends.replay.workloads import make_workload

    config = harness.ReplayConfig()
    trace = make_workload(workload, block_size=config.layout().block_size)
    plugin = get_policy("plugin")
    targets = _targets(plugin)
    patches_of = {"upstream": _snapshot(targets)}
    active = plugin.active()
    active.__enter__()
    patches_of["plugin"] = _snapshot(targets)
    _restore(patches_of["upstream"])
    previous, coordinator.interior_override = coordinator.interior_override, True  # as run_replay
    policy_of = {"upstream": "upstream", "plugin": "upstream" if upstream_twice else "plugin"}
    turn = threading.Condition()
    state: dict[str, Any] = {"next": "upstream", "done": set()}
    # per step: wall us, thread us, requests scheduled
    steps: dict[str, list[tuple[float, float, int]]] = {name: [] for name in POLICIES}
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def replay(name: str, other: str) -> None:
        try:
            run = harness._Run(trace, config, get_policy(policy_of[name]), False, {},
                               harness._default_accept(), None, None)
            scheduler = run.scheduler
            schedule, update = scheduler.schedule, scheduler.update_from_output
            spent = [0.0, 0.0]

            def timed_schedule() -> Any:
                with turn:  # hand the step over, wait for ours
                    if other not in state["done"]:
                        state["next"] = other
                        turn.notify_all()
                        turn.wait_for(lambda: state["next"] == name or other in state["done"])
                _restore(patches_of[policy_of[name]])
                wall, cpu = time.perf_counter(), time.thread_time()
                out = schedule()
                spent[:] = [time.perf_counter() - wall, time.thread_time() - cpu]
                return out

            def timed_update(out: Any, model_output: Any) -> Any:
                wall, cpu = time.perf_counter(), time.thread_time()
                result = update(out, model_output)
                if out.total_num_scheduled_tokens:  # the steps replay counts
                    steps[name].append(((spent[0] + time.perf_counter() - wall) * 1e6,
                                        (spent[1] + time.thread_time() - cpu) * 1e6,
                                        len(out.num_scheduled_tokens)))
                return result

            scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
            with turn:
                turn.wait_for(lambda: state["next"] == name)
            _restore(patches_of[policy_of[name]])
            results[name] = run.run()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            with turn:
                state["done"].add(name)
                turn.notify_all()

    threads = [threading.Thread(target=replay, args=pair)
               for pair in (("upstream", "plugin"), ("plugin", "upstream"))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        _restore(patches_of["plugin"])
        active.__exit__(None, None, None)
        coordinator.interior_override = previous
    if errors:
        raise errors[0]
    row: dict[str, Any] = {"workload": workload}
    for name in POLICIES:
        result = results[name]
        row[name] = {
            "steps": len(steps[name]),
            "median_step_us": statistics.median(wall for wall, _, _ in steps[name]),
            "median_step_thread_us": statistics.median(cpu for _, cpu, _ in steps[name]),
            "thread_s": sum(cpu for _, cpu, _ in steps[name]) / 1e6,
            # a policy that keeps more requests running has longer steps for that reason alone
            "mean_requests_per_step": statistics.mean(n for _, _, n in steps[name]),
            "median_thread_us_per_request": statistics.median(cpu / n for _, cpu, n in steps[name]),
            "token_hit_rate": sum(r.hit_tokens for r in result.requests.values())
            / trace.num_prompt_tokens,
            "scheduler_steps": result.steps,
            "prefill_tokens_computed": result.prefill_tokens_computed,
            "preemptions": result.preemptions,
            "state_mismatches": len(result.mismatches),
        }
    row["median_ratio"] = row["plugin"]["median_step_us"] / row["upstream"]["median_step_us"]
    row["median_thread_ratio"] = (row["plugin"]["median_step_thread_us"]
                                  / row["upstream"]["median_step_thread_us"])
    row["thread_ratio"] = row["plugin"]["thread_s"] / row["upstream"]["thread_s"]
    row["per_request_ratio"] = (row["plugin"]["median_thread_us_per_request"]
                                / row["upstream"]["median_thread_us_per_request"])
    row["requests_per_step_ratio"] = (row["plugin"]["mean_requests_per_step"]
                                      / row["upstream"]["mean_requests_per_step"])
    return row


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--upstream-twice", action="store_true",
                        help="the plugin's slot replays upstream too: the bench's own noise and "
                             "order bias (ratio 1.0 if it had none)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds must be a positive integer, got {args.rounds}", file=sys.stderr)
        return 2
    rows = []
    for index in range(args.rounds):
        row = lockstep_round(args.workload, args.upstream_twice)
        rows.append(row)
        up, plug = row["upstream"], row["plugin"]
        print(f"{args.workload} round {index}: median step {up['median_step_us']:.0f} / "
              f"{plug['median_step_us']:.0f} us (ratio {row['median_ratio']:.3f}), median step "
              f"thread time ratio {row['median_thread_ratio']:.3f}, thread time "
              f"{up['thread_s']:.2f} / {plug['thread_s']:.2f} s (ratio {row['thread_ratio']:.3f}); "
              f"hit rate {up['token_hit_rate']:.4f} / {plug['token_hit_rate']:.4f}, "
              f"prefill tokens {up['prefill_tokens_computed']} / {plug['prefill_tokens_computed']}, "
              f"mismatches {up['state_mismatches']} / {plug['state_mismatches']}", file=sys.stderr)
    summary = {"workload": args.workload, "upstream_twice": args.upstream_twice, "rounds": rows,
               "median_ratio": statistics.median(r["median_ratio"] for r in rows),
               "median_thread_ratio": statistics.median(r["median_thread_ratio"] for r in rows),
               "thread_ratio": statistics.median(r["thread_ratio"] for r in rows),
               "per_request_ratio": statistics.median(r["per_request_ratio"] for r in rows),
               "requests_per_step_ratio": rows[0]["requests_per_step_ratio"]}
    print(f"{args.workload}: median of per-round ratios: step {summary['median_ratio']:.3f}, "
          f"step thread time {summary['median_thread_ratio']:.3f}, "
          f"thread time {summary['thread_ratio']:.3f}; per scheduled request "
          f"{summary['per_request_ratio']:.3f}, requests per step "
          f"{summary['requests_per_step_ratio']:.3f}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
