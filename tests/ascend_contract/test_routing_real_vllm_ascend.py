"""vllm-ascend's own align-mode copy path reaches the plugin's ``ascend`` backend.

Per release (vllm-ascend 0.23.0 beside vLLM 0.23.0, 0.26.0rc1 beside 0.26.0) and per build
(A2, 310P), ``route_copies.py`` starts a real ``NPUWorker`` through vLLM's
``WorkerWrapperBase.init_worker`` (general plugins loaded from their entry points, then
vllm-ascend's ``adapt_patch()`` inside the plugin-wrapped ``NPUWorker.__init__``) and makes the
align-branch calls of ``NPUModelRunner.execute_model`` (vllm-ascend's ``preprocess_mamba``,
then ``do_mamba_copy_block``) on CPU tensors. Only device queries are stood in
(``npu_standin.show_one_npu``); every copy is a CPU torch op. Not driven: ``execute_model``
itself (model forward, ACL graphs need CANN); ``runner_calls`` checks its align branch makes
these calls.
"""

from __future__ import annotations

import pytest
from ascend_sources import RELEASES, run_beside

from vllm_hybrid_backends import cli

pytestmark = [pytest.mark.ascend_contract, pytest.mark.slow]

ROUTES = [pytest.param((release.values[0], build), id=f"{release.id}-{build}")
          for release in RELEASES for build in ("A2", "310P")]
PLUGIN_COPIES = "vllm_hybrid_backends.patches.patch_vllm_v1_worker_mamba_utils"
THEIR_PATCH = "vllm_ascend.patch.worker.patch_mamba_utils"
THEIR_310P_COPIES = [f"{THEIR_PATCH}._collect_mamba_copy_meta_torch",
                     f"{THEIR_PATCH}._do_mamba_copy_block_torch"]


@pytest.fixture(scope="module", params=ROUTES)
def routed(request):
    release, build = request.param
    return run_beside(release, "route_copies.py", build)


def test_a_real_npu_worker_starts_with_the_plugin_loaded_and_selects_ascend(routed):
    # on vLLM 0.23 / 0.26 the plugin's NPUWorker.__init__ wrapper once raised here
    # (no vllm.triton_utils.dispatcher; patches this vLLM does not need re-applied)
    assert routed["worker"] == "vllm_ascend.worker.worker.NPUWorker"
    assert routed["is_310p"] is (routed["build"] == "310P")
    assert routed["selected_backend"] == "ascend"


def test_only_npu_runtime_modules_are_stood_in(routed):
    assert set(routed["standins_served"]) <= {"torch", "torch_npu", "acl", "torchair",
                                               "npugraph_ex", "mindie_turbo"}


def test_the_driven_calls_are_those_of_their_model_runners_align_branch(routed):
    assert routed["runner_calls"] == {"preprocess_mamba": True, "do_mamba_copy_block": True,
                                      "preprocess_before_copy": True,
                                      "buffers_from_get_mamba_bufs": True}


def test_their_preprocess_calls_the_plugins_copy_functions_after_worker_init(routed):
    assert routed["installed_after_worker_init"] == {
        "preprocess_mamba": THEIR_PATCH,  # theirs is kept: it defers the copy past the KV load
        "collect_mamba_copy_meta": PLUGIN_COPIES, "do_mamba_copy_block": PLUGIN_COPIES}


@pytest.mark.parametrize("step, hook", [
    pytest.param("blocks", "hb_copy_state_blocks", id="block-moves"),
    pytest.param("token_bias", "hb_precopy_running_states", id="accepted-tokens-bias"),
])
def test_their_align_copies_run_on_the_ascend_backend_and_equal_the_reference(routed, step, hook):
    assert routed["conv_dim_first"] is False  # the SD conv layout: the bias step ran
    moved = routed["with_reapply"][step]
    assert moved["moves"] > 0
    assert moved["hook_calls"] == {"hb_copy_state_blocks": 0, "hb_precopy_running_states": 0,
                                   hook: 1}
    assert moved["equal_to_reference"] is True  # NaN-poisoned destinations, fresh inputs
    assert moved["nan_left_in_destinations"] is False


def test_their_worker_patches_ran_before_the_plugin_applied_its_copy_patch(routed):
    # the plugin's own capability check imports vllm_ascend.worker.worker, whose model runner
    # imports vllm_ascend.patch.worker.* and so runs all their worker patches first: in this
    # start order the plugin's copy functions are installed last even without the re-apply
    assert routed["theirs_loaded_before_first_plugin_apply"] is True


def test_without_the_reapply_310p_copies_bypass_the_backend_a2_copies_do_not(routed):
    """The control: vllm-ascend's copy patch run again after the plugin's (their module body:
    the assignments NPUWorker.__init__'s adapt_patch makes), nothing re-applied. On 310P builds
    it takes collect/do back (their tensor-view copies, still equal to the reference, and no
    hook call). A2 builds of these releases never re-assign those two functions."""
    on_310p = routed["build"] == "310P"
    owner = THEIR_PATCH if on_310p else PLUGIN_COPIES
    installed = routed["installed_after_their_patch_alone"]
    assert (installed["collect_mamba_copy_meta"], installed["do_mamba_copy_block"]) == (owner, owner)
    for step in ("blocks", "token_bias"):
        moved = routed["without_reapply"][step]
        assert sum(moved["hook_calls"].values()) == (0 if on_310p else 1)
        assert moved["equal_to_reference"] is True


def test_the_reapply_in_the_real_npu_worker_init_restores_the_routing(routed):
    """After the control, the real plugin-wrapped NPUWorker.__init__ runs once more: its
    re-apply puts the plugin's copy functions back over theirs. Fails on 310P builds if the
    wrapper stops re-applying (checked by deleting the call: 0 hook calls)."""
    installed = routed["installed_after_next_worker_init"]
    assert (installed["collect_mamba_copy_meta"], installed["do_mamba_copy_block"]) == (
        PLUGIN_COPIES, PLUGIN_COPIES)
    for step, hook in (("blocks", "hb_copy_state_blocks"),
                       ("token_bias", "hb_precopy_running_states")):
        moved = routed["after_next_worker_init"][step]
        assert moved["hook_calls"][hook] == 1
        assert moved["equal_to_reference"] is True


def test_the_vllm_ascend_functions_the_plugin_wraps_are_named_in_doctor(routed):
    wrapped = routed["wrapped_vllm_ascend_functions"]
    assert wrapped == (THEIR_310P_COPIES if routed["build"] == "310P" else [])
    doctor_text = " ".join(cli.VLLM_ASCEND_COMPOSITION + cli.VLLM_ASCEND_DEFERRED)
    assert all(name.rsplit(".", 1)[-1] in doctor_text for name in wrapped)


def test_their_gdn_builder_bypasses_the_plugins_build_patch_and_the_worker_says_so(routed):
    # AscendGDNAttentionMetadataBuilder.build never runs vLLM's build, which the gdn_attn patch
    # wraps: the worker must not claim GDN interior states (the engine would plan blocks no
    # worker writes); doctor names the deferral
    assert routed["gdn_builder_calls_vllms_build"] is False
    assert routed["worker_report"]["forward_limits"]["gdn_interior_states"] != ""
    assert any("AscendGDNAttentionMetadataBuilder" in line for line in cli.VLLM_ASCEND_DEFERRED)
