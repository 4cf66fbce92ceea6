"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, expert-parallel
across the TP group.

Semantics (transformers' MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock and
Qwen3MoeSparseMoeBlock, x: [T, H]):
    p = softmax(float32(x @ gate^T))                   # [T, E] router probabilities
    w, e = topk(p, k)                                   # [T, k]
    w /= w.sum(-1)                                      # Mixtral; Qwen if norm_topk_prob
    w = float32(dtype(w))                               # Qwen: rounded to x's dtype
    y[t] = sum_j w[t, j] * down_e (silu(gate_e x_t) * up_e x_t),  e = e[t, j]
    y += sigmoid(x @ shared_expert_gate^T) * shared_expert(x)    # Qwen2-MoE
each expert's weighted output cast back to x's dtype before the sum, as transformers does
(a Qwen weight rounded to x's dtype times a float32 output, rounded once, is exactly the
product transformers takes in x's dtype).

Expert parallelism: with a `TPGroup` of size N, rank r holds experts
[r * E/N, (r+1) * E/N) whole (E must divide by N) and the router replicated. Hidden
states are whole on every rank (attention's o_proj all-reduces them), so each rank
routes every token, computes its own experts' weighted outputs for the tokens sent to
them (0 for the others) and one all-reduce sums the ranks' partial [T, H]: the same
single collective per layer a row-parallel MLP costs, with no all-to-all.
Example (E 8, N 2, k 2): rank 1 holds experts 4-7; a token routed to experts 2 and 5
gets w_5 * expert_5 from rank 1 and w_2 * expert_2 from rank 0.
Qwen2-MoE's shared expert is a dense MLP split as one (gate_up column-, down
row-parallel): rank r's down projection gives a partial sum over its intermediate
features, which joins the routed experts' partial before the same one all-reduce. Its
gate is replicated and computed on the whole x on every rank, so each rank scales its
partial by the whole sigmoid gate: sum_r g * s_r = g * s.

Three compute paths of the same result (tests compare each with transformers):
- fused (CUDA: eager and captured steps): `kernels.fused_moe`, Triton. The (token,
  expert) pairs are grouped by local expert on the device (padded per-expert blocks,
  a device-side block count) and two kernels run the gate_up GEMM with SiLU * up in its
  epilogue and the down GEMM with the routing weight, over the blocks with pairs only:
  the FLOPs and weight bytes the routing asks for, no host sync, fixed launch shapes,
  so CUDA graphs capture it.
- grouped (CPU): the pairs sorted by expert and one GEMM pair per hit expert over its
  tokens (`kernels.fused_moe`'s torch reference); it reads the per-expert counts on the
  host (one sync per layer) and runs a data-dependent number of GEMMs, which a CUDA
  graph cannot capture.
- dense: every local expert runs on every token as one batched GEMM pair and its output
  is scaled by the token's routing weight where the token picked it, dropped elsewhere.
  No host sync, fixed shapes; E/k times the expert FLOPs the routing needs (4x for
  Mixtral's 8 experts, top-2) and a transient [E_local, T, 2I] activation. It is what
  auto captures where the kernels run the torch reference (LORAFLEET_KERNELS=reference).
`SparseMoE.compute` picks: "auto" (fused where the Triton kernels run, i.e. CUDA; else
grouped, or dense while a CUDA graph is captured), or "fused" / "grouped" / "dense"
always ("fused" on CPU runs the torch reference unless LORAFLEET_KERNELS=triton with the
Triton interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import backend_for, fused_moe
from kernels.moe_reference import fused_moe_ref
from replica.layers.linear import Linear, Sliceable, shape_of
from replica.models.config import ModelConfig
from replica.models.mlp import MLP
from replica.parallel import SINGLE, TPGroup

COMPUTE_PATHS = ("auto", "fused", "grouped", "dense")


class Router(nn.Module):
    """The replicated router: weight [E, H] (the checkpoint's mlp.gate.weight).

    normalize: the top-k weights are renormalised to sum to 1 (Mixtral; a Qwen MoE's
    norm_topk_prob). cast: they are rounded to x's dtype (Qwen MoE routers)."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, normalize: bool = True, cast: bool = False
    ):
        super().__init__()
        self.top_k = top_k
        self.normalize = normalize
        self.cast = cast
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights float32 [T, k], experts long [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast:
            weights = weights.to(x.dtype).float()
        return weights, experts


class LocalExperts(nn.Module):
    """This rank's experts [first, first + num_local), in transformers' fused layout:
    gate_up_proj [E_local, 2I, H] (gate rows then up rows), down_proj [E_local, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.num_experts = num_experts
        self.num_local = tp.shard(num_experts, "num_local_experts")
        self.first = tp.rank * self.num_local
        self.intermediate = intermediate
        h, i, n = hidden, intermediate, self.num_local
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n, h, i), requires_grad=False)

    def pieces(self, attr: str) -> set[tuple[int, int]]:
        """Every (local expert, part) a parameter is loaded in: gate_up_proj has parts
        0 (gate) and 1 (up), down_proj part 0."""
        parts = (0, 1) if attr == "gate_up_proj" else (0,)
        return {(e, p) for e in range(self.num_local) for p in parts}

    def weight_loader(
        self, attr: str, loaded: Sliceable, expert: int | None, part: int
    ) -> set[tuple[int, int]]:
        """Copy this rank's experts of a checkpoint tensor into parameter `attr`, reading
        nothing else of it; -> the (local expert, part) pieces written.

        loaded: expert None: the fused [E, 2I, H] / [E, H, I] tensor (all parts);
        else global expert `expert`'s [I, H] w1 (part 0) / w3 (part 1) or [H, I] w2;
        a tensor or a safetensors slice. Another rank's expert is skipped (no read).
        """
        param = getattr(self, attr)
        shape = shape_of(loaded)
        if expert is None:
            want = (self.num_experts,) + tuple(param.shape[1:])
            if shape != want:
                raise ValueError(f"{attr}: shape {shape} does not fit {want}")
            param.data.copy_(loaded[self.first : self.first + self.num_local])
            return self.pieces(attr)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert}; allowed: 0..{self.num_experts - 1}")
        local = expert - self.first
        if not 0 <= local < self.num_local:
            return set()
        target = param.data[local]
        if attr == "gate_up_proj":
            target = target.narrow(0, part * self.intermediate, self.intermediate)
        if shape != tuple(target.shape):
            raise ValueError(f"expert {expert}: shape {shape} does not fit {list(target.shape)}")
        target.copy_(loaded[:])
        return {(local, part)}

    def fused(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; local: int [T, k] local expert of each choice (outside [0, E_local):
        another rank's); weights: float32 [T, k] -> [T, H] this rank's part
        (`kernels.fused_moe`: Triton on CUDA, no host sync)."""
        return fused_moe(x, self.gate_up_proj, self.down_proj, local, weights)

    def grouped(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """fused's result, one GEMM pair per hit expert (`kernels.fused_moe`'s torch
        reference on any backend: one host sync)."""
        return fused_moe_ref(x, self.gate_up_proj, self.down_proj, local, weights)

    def dense(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """grouped's result, from every local expert on every token (fixed shapes). An
        expert's output on a token that did not pick it is selected away, not scaled by 0:
        where it overflows (inf, nan: float16) inf * 0 would be nan in that token."""
        ids = torch.arange(self.num_local, device=x.device)
        picked = local.unsqueeze(-1) == ids  # [T, k, E_local]
        route = (weights.unsqueeze(-1) * picked).sum(1).t().unsqueeze(-1)  # [E_local, T, 1]
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        down = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E_local, T, H]
        mask = picked.any(1).t().unsqueeze(-1)  # [E_local, T, 1]
        return torch.where(mask, down.float() * route, 0.0).to(x.dtype).sum(0)


class SparseMoE(nn.Module):
    """The MoE block of one decoder layer: router `gate` (replicated), this rank's
    `experts` and, for Qwen2-MoE, this rank's shard of `shared_expert` with its
    replicated `shared_expert_gate` [1, H]; forward x: [T, H] -> [T, H], summed over
    the TP group."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        h = cfg.hidden_size
        self.gate = Router(
            h, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.moe_weights_cast
        )
        self.experts = LocalExperts(cfg.num_experts, h, cfg.moe_intermediate_size, tp)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(h, shared, tp, "shared_expert_intermediate_size")
            self.shared_expert_gate = Linear(h, (1,), bias=False)
        self.compute = "auto"
        """"auto" (fused where the Triton kernels run; else grouped, dense while a CUDA
        graph is captured), "fused", "grouped" or "dense" (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> this rank's partial [T, H] (forward before the all-reduce)."""
        weights, experts = self.gate(x)
        local = experts - self.experts.first
        y = getattr(self.experts, self.path(x))(x, local, weights)
        if self.shared_expert is not None:
            y += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return y

    def path(self, x: torch.Tensor) -> str:
        """The compute path this forward of x takes (`compute`, "auto" resolved)."""
        if self.compute not in COMPUTE_PATHS:
            raise ValueError(f"compute={self.compute!r}; allowed: {', '.join(COMPUTE_PATHS)}")
        if self.compute != "auto":
            return self.compute
        if x.is_cuda and backend_for(x.device) == "triton":
            return "fused"
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return "dense"
        return "grouped"
