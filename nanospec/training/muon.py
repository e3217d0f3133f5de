"""
Muon: SGD with momentum, where each weight matrix's update is first orthogonalized.

A gradient step on a weight matrix W (out, in) is dominated by a few directions: the update's singular values
span orders of magnitude, so a learning rate safe for the largest one barely moves the rest. Muon replaces the
(Nesterov) momentum M = U S V^T by U V^T, every singular value set to 1, and steps along that. U V^T is
computed without an SVD by a Newton-Schulz iteration, five matrix products per step.

Worked example: M = [[3, 0], [0, 0.01]] has singular values 3 and 0.01: a step along M moves the first direction
300 times as far as the second. orthogonalize(M) = [[0.70, 0], [0, 1.16]]: both now move about as far (five
iterations leave the singular values near 1, not at 1; that trains as well and costs five products).

Only the hidden matrices of the transformer blocks (attention and MLP weights) take Muon; embeddings, the
unembedding, norms and the MTP heads keep AdamW, as in the papers. In nanospec's sweep (8 layers x 128, batch
8 x 256, fp32, 900 steps; docs/training.md, "Muon") the target reached 2.13 bits per byte of validation text with
Muon and 2.37 with AdamW alone, and Muon was already at 2.23 by step 600; its step cost about 15% more time.

Papers/notes: Jordan et al. 2024, "Muon: an optimizer for hidden layers" (kellerjordan.github.io/posts/muon);
Liu et al. 2025, "Muon is scalable for LLM training", arXiv 2502.16982.
"""
import torch


def orthogonalize(G, steps=5):
    """G (m, n) -> about U V^T, where G = U S V^T. A quintic Newton-Schulz iteration with coefficients chosen to
    pull every singular value into about [0.7, 1.2] fast rather than to exactly 1 (which trains as well)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7)  # singular values now <= 1, where the iteration converges
    tall = X.size(0) > X.size(1)
    if tall:  # iterate on the smaller Gram matrix X X^T
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    """Momentum + orthogonalized update for 2-D weights. lr is the step's size per singular direction."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                buf = state["momentum"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = orthogonalize(p.grad.add(buf, alpha=group["momentum"]))  # Nesterov momentum
                # a tall matrix's U V^T has smaller entries: scale so every shape moves its outputs alike
                p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def hidden_matrices(model):
    """Names of the parameters Muon should train: the 2-D weights inside transformer blocks."""
    return {name for name, p in model.named_parameters() if p.dim() == 2 and ".blocks." in f".{name}"}
