"""The gated delta rule, one token at a time in fp32: the reference the GDN state tests compare
vLLM's chunked kernels (FLA's Triton one, vLLM-CPU's) against.

Per head, with the state ``S`` laid out ``[v, k]`` as vLLM's GDN cache keeps it::

    S <- exp(g_t) * S
    S <- S + beta_t * (v_t - S k_t) k_t^T
"""

from __future__ import annotations

import torch

__all__ = ["gated_delta_rule_state"]


def gated_delta_rule_state(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The state after tokens ``k`` ``[T, H, K]``, ``v`` ``[T, H, V]``, log-space gates ``g`` and
    betas ``beta`` ``[T, H]``, from ``initial_state`` ``[H, V, K]`` (zeros when None): fp32
    ``[H, V, K]``. Keys are used as given (normalise them first where the kernel does)."""
    if k.dim() != 3 or v.dim() != 3 or g.shape != k.shape[:2] or beta.shape != k.shape[:2]:
        raise ValueError(f"expected k [T, H, K], v [T, H, V], g and beta [T, H]; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    heads, v_dim, k_dim = k.shape[1], v.shape[2], k.shape[2]
    state = torch.zeros(heads, v_dim, k_dim) if initial_state is None else initial_state.float().clone()
    for t in range(k.shape[0]):
        key, value = k[t].float(), v[t].float()
        state = state * torch.exp(g[t].float()).view(heads, 1, 1)
        error = value - torch.einsum("hvk,hk->hv", state, key)
        state = state + beta[t].float().view(heads, 1, 1) * torch.einsum("hv,hk->hvk", error, key)
    return state
