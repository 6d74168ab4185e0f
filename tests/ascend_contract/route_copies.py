"""Run inside a process whose sys.path has one vLLM release and its vllm-ascend first: start a
real vllm-ascend worker the way vLLM does, then drive the align-mode state copies of
vllm-ascend's model runner and print, as JSON, which backend moved the states and whether they
equal the reference backend's result.

``python route_copies.py A2|310P``: the vllm-ascend build to act as (vllm-ascend reads it from
its build-time ``_build_info.__device_type__``; the wheels on the registry are A2 builds).

The worker comes up through vLLM's own ``WorkerWrapperBase.init_worker``: vLLM's
``load_general_plugins`` (vllm-ascend's general plugins and this plugin's ``register()``, found
through their entry points), then the real ``NPUWorker.__init__`` (vllm-ascend's
``adapt_patch()``, wrapped by the plugin). Then the two calls of the align branch of
``NPUModelRunner.execute_model``: ``mamba_utils.preprocess_mamba`` (vllm-ascend's, which calls
``mamba_utils.collect_mamba_copy_meta``) with the runner's own buffers
(``NPUModelRunner._get_mamba_bufs``), and ``mamba_utils.do_mamba_copy_block``. What cannot run
without CANN: ``execute_model`` itself (the model forward, ACL graphs); its align branch is
checked to make exactly these calls (``runner_calls``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import npu_standin

BUILD = sys.argv[1]
SOC = {"A2": "Ascend910B2", "310P": "Ascend310P3"}[BUILD]
npu_standin.show_one_npu(SOC)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm_ascend._build_info as build_info  # noqa: E402

build_info.__device_type__ = "_310P" if BUILD == "310P" else "A2"

import vllm.v1.worker.mamba_utils as mamba_utils  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateCopyFuncCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.models.llama import LlamaForCausalLM  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState  # noqa: E402
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: E402

from vllm_hybrid_backends import handshake, plugins, reference  # noqa: E402
from vllm_hybrid_backends.patches import patch_vllm_v1_worker_mamba_utils as plugin_copies  # noqa: E402
from vllm_hybrid_backends.types import MambaStateTensor, StateKind  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 12
CONV_LEN, CONV_DIM, HEADS, HEAD_DIM = 3, 8, 2, 4
LAYERS = ("model.layers.0.linear_attn", "model.layers.1.linear_attn")
MAMBA_GROUP = 1  # group 0 is full attention, as in a hybrid model
COPY_HOOKS = ("hb_copy_state_blocks", "hb_precopy_running_states")

# ---- a spy on the ascend backend's hook implementations, before anything selects them -------
calls: dict[str, int] = dict.fromkeys(COPY_HOOKS, 0)
for hook in COPY_HOOKS:
    for impl in getattr(plugins.get_plugin_manager().hook, hook).get_hookimpls():
        if impl.plugin_name == "ascend":
            def counted(*args: Any, _inner: Any = impl.function, _hook: str = hook,
                        **kwargs: Any) -> Any:
                calls[_hook] += 1
                return _inner(*args, **kwargs)

            impl.function = counted


# ---- whether vllm-ascend's worker patches ran before the plugin applied its copy patch -----
THEIR_COPY_PATCH = "vllm_ascend.patch.worker.patch_mamba_utils"
order: dict[str, bool] = {}
_plugin_apply = plugin_copies.apply


def _recording_apply() -> None:
    order.setdefault("theirs_loaded_before_first_plugin_apply", THEIR_COPY_PATCH in sys.modules)
    _plugin_apply()


plugin_copies.apply = _recording_apply


# ---- the worker, as vLLM starts it ------------------------------------------------------------
def start_worker() -> Any:
    model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}))
    # registered as a class: vLLM inspects it in this process, not in a subprocess that would
    # import vllm-ascend's platform without the stand-in
    ModelRegistry.register_model("LlamaForCausalLM", LlamaForCausalLM)
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"),
        cache_config=CacheConfig(cache_dtype="bfloat16", mamba_cache_mode="align",
                                 enable_prefix_caching=True))
    config.parallel_config.worker_cls = "vllm_ascend.worker.worker.NPUWorker"
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker([dict(vllm_config=config, local_rank=0, rank=0, is_driver_worker=True,
                              distributed_init_method="tcp://127.0.0.1:29500")])
    return wrapper.worker


worker = start_worker()
plugin_copies.apply = _plugin_apply
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner  # noqa: E402


def runner_calls() -> dict[str, bool]:
    """The align-mode calls the real ``NPUModelRunner.execute_model`` makes (this script
    makes the same ones, in the same order)."""
    source = inspect.getsource(NPUModelRunner.execute_model)
    preprocess = source.find("mamba_utils.preprocess_mamba(")
    copy = source.find("mamba_utils.do_mamba_copy_block(preprocess_bufs)")
    return {"preprocess_mamba": preprocess >= 0, "do_mamba_copy_block": copy >= 0,
            "preprocess_before_copy": 0 <= preprocess < copy,
            "buffers_from_get_mamba_bufs": "self._get_mamba_bufs()" in source}


# ---- the model runner's align-mode inputs -------------------------------------------------------
conv_dim_first = bool(is_conv_state_dim_first())
copy_funcs = MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
conv_shape = (CONV_DIM, CONV_LEN) if conv_dim_first else (CONV_LEN, CONV_DIM)
mamba_spec = MambaSpec(block_size=BLOCK_SIZE, shapes=(conv_shape, (HEADS, HEAD_DIM, HEAD_DIM)),
                       dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")
attention_spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16,
                                   dtype=torch.bfloat16)
kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["model.layers.2.self_attn"], attention_spec),
    KVCacheGroupSpec(list(LAYERS), mamba_spec)])
states_by_layer = {layer: [torch.empty((NUM_BLOCKS, *shape), dtype=dtype)
                           for shape, dtype in zip(mamba_spec.shapes, mamba_spec.dtypes)]
                   for layer in LAYERS}
forward_context = {layer: SimpleNamespace(kv_cache=states) for layer, states in
                   states_by_layer.items()}
conv_kind = StateKind.CONV_DS if conv_dim_first else StateKind.CONV_SD
state_views = [MambaStateTensor(tensor, kind, 0, layer)
               for layer, (conv, temporal) in states_by_layer.items()
               for tensor, kind in ((conv, conv_kind), (temporal, StateKind.TEMPORAL))]

runner = SimpleNamespace(
    cache_config=worker.cache_config, _mamba_bufs=None, max_num_reqs=8,
    kv_cache_config=kv_cache_config, speculative_config=None, model_config=worker.model_config,
    device=torch.device("cpu"), model=SimpleNamespace(get_mamba_state_copy_func=lambda: copy_funcs),
    _make_buffer=lambda *size, dtype, numpy=True: CpuGpuBuffer(
        *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=numpy))


def request(req_id: str, mamba_blocks: list[int], computed: int) -> CachedRequestState:
    fields = dict(req_id=req_id, prompt_token_ids=list(range(computed + 20)), mm_features=[],
                  sampling_params=None, generator=None, output_token_ids=[],
                  block_ids=(list(range(len(mamba_blocks))), mamba_blocks),
                  num_computed_tokens=computed)
    accepted = inspect.signature(CachedRequestState).parameters
    return CachedRequestState(**{k: v for k, v in fields.items() if k in accepted})


def run_step(seed: int, scheduled: dict[str, int], accepted: list[int],
             known_state_cols: dict[str, int], requests: dict[str, CachedRequestState]
             ) -> dict[str, Any]:
    """One ``execute_model`` align step; returns hook calls and the comparison."""
    generator = torch.Generator().manual_seed(seed)
    for view in state_views:
        view.tensor.copy_(torch.randn(view.tensor.shape, generator=generator))
    # the moves this step must make, by the align rule, for the reference
    tables, src_cols, dst_cols, biases = [], [], [], []
    for i, req_id in enumerate(scheduled):
        req = requests[req_id]
        prev = known_state_cols.get(req_id, (req.num_computed_tokens - 1) // BLOCK_SIZE)
        curr = -(-(req.num_computed_tokens + scheduled[req_id]) // BLOCK_SIZE) - 1
        if prev != -1 and prev != curr:  # the condition of vllm-ascend's preprocess_mamba
            tables.append(req.block_ids[MAMBA_GROUP])
            src_cols.append(prev)
            dst_cols.append(curr)
            biases.append(accepted[i] - 1)
    for table, dst in zip(tables, dst_cols):  # destinations start as NaN
        for view in state_views:
            view.tensor[table[dst]] = float("nan")
    expected = [view.tensor.clone() for view in state_views]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    reference.precopy_running_states(
        [MambaStateTensor(t, v.kind, 0, v.layer) for t, v in zip(expected, state_views)],
        [block_table], torch.tensor(src_cols), torch.tensor(dst_cols), torch.tensor(biases))

    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.num_scheduled_tokens = dict(scheduled)
    input_batch = SimpleNamespace(req_ids=list(scheduled),
                                  num_accepted_tokens_cpu=np.array(accepted, dtype=np.int32))
    before = dict(calls)
    preprocess_bufs = NPUModelRunner._get_mamba_bufs(runner).preprocess
    mamba_utils.preprocess_mamba(scheduler_output, kv_cache_config, worker.cache_config,
                                 dict(known_state_cols), input_batch, requests, forward_context,
                                 copy_funcs, preprocess_bufs)
    mamba_utils.do_mamba_copy_block(preprocess_bufs)
    return {"moves": len(tables),
            "hook_calls": {hook: calls[hook] - before[hook] for hook in COPY_HOOKS},
            "equal_to_reference": all(_same_bits(a.tensor, b) for a, b in zip(state_views, expected)),
            "nan_left_in_destinations": any(
                bool(view.tensor[table[dst]].isnan().any()) for view in state_views
                for table, dst in zip(tables, dst_cols) if view.kind is StateKind.TEMPORAL)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}
    return bool(torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()])))


def steps() -> dict[str, Any]:
    """Step 1: block moves only (a prefix hit restored, a request crossing a block);
    step 2: a request that accepted speculative tokens (a token bias, conv SD layout only)."""
    requests = {"hit": request("hit", [3, 7, 1, 9], 32),  # restore column 1 -> 3
                "cross": request("cross", [5, 2, 10], 15),  # column 0 -> 1
                "stay": request("stay", [4, 6, 8], 40)}  # stays in column 2
    out = {"blocks": run_step(1, {"hit": 20, "cross": 10, "stay": 1}, [1, 1, 1],
                              {"stay": 2}, requests)}
    if not conv_dim_first:  # vLLM refuses a token bias for the DS conv layout
        out["token_bias"] = run_step(2, {"cross": 10, "stay": 2}, [3, 1],
                                     {"cross": 0, "stay": 2}, requests)
    return out


def installed() -> dict[str, str]:
    return {name: getattr(mamba_utils, name).__module__
            for name in ("preprocess_mamba", "collect_mamba_copy_meta", "do_mamba_copy_block")}


def gdn_builder_calls_vllms_build() -> bool:
    """Whether vllm-ascend's GDN metadata builder runs vLLM's ``build`` (which the plugin's
    gdn_attn patch wraps)."""
    from vllm_ascend.ops.gdn_attn_builder import AscendGDNAttentionMetadataBuilder

    source = inspect.getsource(AscendGDNAttentionMetadataBuilder.build)
    return "super().build(" in source or "GDNAttentionMetadataBuilder.build(" in source


result: dict[str, Any] = {
    "build": BUILD, "is_310p": importlib.import_module("vllm_ascend.utils").is_310p(),
    "worker": f"{type(worker).__module__}.{type(worker).__qualname__}",
    "selected_backend": plugins.selected_backend(), "conv_dim_first": conv_dim_first,
    "runner_calls": runner_calls(), "installed_after_worker_init": installed(),
    "wrapped_vllm_ascend_functions": sorted(
        f"{f.__module__}.{f.__qualname__}" for f in plugin_copies._ORIGINALS.values()
        if f.__module__.startswith("vllm_ascend")),
    "gdn_builder_calls_vllms_build": gdn_builder_calls_vllms_build(),
    "worker_report": handshake.worker_report(worker),
    "standins_served": sorted({name.split(".")[0] for name in npu_standin.SERVED}),
    "with_reapply": steps(),
}
result.update(order)
# The control: what the worker calls when vllm-ascend's copy patch ran after the plugin's and
# nothing re-applied: their module body run again makes exactly the assignments it made.
importlib.reload(sys.modules[THEIR_COPY_PATCH])
result["installed_after_their_patch_alone"] = installed()
result["without_reapply"] = steps()
# Then the real, plugin-wrapped NPUWorker.__init__ once more: its re-apply must restore the
# routing (without the re-apply, 310P copies would stay vllm-ascend's).
start_worker()
result["installed_after_next_worker_init"] = installed()
result["after_next_worker_init"] = steps()
print(json.dumps(result))
