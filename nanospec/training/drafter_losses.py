"""
What each drafter that learns from the frozen target minimises, beside nothing else: the models themselves are in
nanospec/model/drafters/ (eagle.py, parallelspec.py, early_exit.py; the MTP heads' own phase is training/heads.py),
the stages that train them in nanospec/training/drafters.py, and why each recipe is what it is in docs/training-notes.md.
Only training imports this module.

  draft_losses  the draft GPT of `speculative`, distilled to the target's next-token law, KL(p_target || q_draft)
  eagle_losses  the EAGLE head, teacher-forced on the target's true features: feature regression + the target's law
  exit_losses   each early-exit adapter distilled to the target's next-token law, KL(p_target || q_draft)
  mask_losses   the ParallelSpec drafter, many groups of masks per sequence, each mask learning the target's argmax
"""
import torch
from torch.nn import functional as F

from nanospec.model.drafters.early_exit import exit_logits

FEATURE_WEIGHT = 1.0  # EAGLE: SmoothL1 on features, what keeps the head's own features usable for deeper drafts
DIST_WEIGHT = 3.0  # EAGLE: soft cross-entropy to the target's next-token law, what acceptance needs: 3.0 over 0.3
# lifted sum(min(p, q)) at t=1 from 0.70 to 0.72 at equal steps (docs/training-notes.md)


def draft_losses(draft, target, w):
    """w (B, T) windows -> {kl: KL(p_target || q_draft) per token, the loss; accept: sum(min(p, q)), the chance that
    a guess drawn from q is accepted at temperature 1 (Leviathan's alpha), averaged over the positions; agree: how
    often the draft's argmax is the target's}. Distillation (DistillSpec, Zhou et al. 2023, arXiv 2310.08461):
    acceptance is about agreeing with the target's whole law, which says more per token than the corpus's one next
    token (docs/training-notes.md: 0.52 -> 0.68 at t=1 in 90 s of training where it had 40)."""
    with torch.no_grad():
        log_p = torch.log_softmax(target(w).logits.float(), dim=-1)  # (B, T, V)
    log_q = torch.log_softmax(draft(w).logits.float(), dim=-1)  # (B, T, V)
    V = log_p.size(-1)
    kl = F.kl_div(log_q.reshape(-1, V), log_p.reshape(-1, V), log_target=True, reduction="batchmean")
    with torch.no_grad():
        accept = torch.minimum(log_p, log_q).exp().sum(-1).mean()  # min(p, q) = exp(min(log p, log q))
        agree = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
    return {"kl": kl, "accept": accept, "agree": agree}


def eagle_losses(eagle, target, w):
    """w (B, T+1) token windows -> {feature, dist, total, acc}: the two losses, their weighted sum, and how often
    the head's top-1 guess for x_{t+2} equals the target's (teacher-forced acceptance of a one-token draft)."""
    with torch.no_grad():
        out = target(w)  # hidden (B, T+1, C) = f_0..f_T, logits (B, T+1, V)
    f = out.hidden
    pred = eagle(target, w[:, 1:], f[:, :-1])  # reads f_0..f_{T-1}: predicts f_1..f_T, drafts x_2..x_{T+1}
    V = pred.logits.size(-1)
    p_target = torch.softmax(out.logits[:, 1:], dim=-1)  # (B, T, V) the target's law of x_{t+2}
    scale = f[:, 1:].pow(2).mean().sqrt()  # the features' RMS: the loss judges the error relative to it
    losses = {"feature": F.smooth_l1_loss(pred.hidden / scale, f[:, 1:] / scale),
              "dist": F.cross_entropy(pred.logits.reshape(-1, V), p_target.reshape(-1, V))}
    losses["total"] = FEATURE_WEIGHT * losses["feature"] + DIST_WEIGHT * losses["dist"]
    losses["acc"] = (pred.logits.argmax(-1) == out.logits[:, 1:].argmax(-1)).float().mean()
    return losses


def exit_hidden_states(target, w):
    """w (B, T) -> [block 1's output, ..., block L's output], each (B, T, C), and the target's logits (B, T, V)."""
    L = target.config.n_layer
    hidden = [target(w, layers=(0, 1)).hidden]
    for i in range(1, L - 1):
        hidden.append(target(None, layers=(i, i + 1), hidden_in=hidden[-1]).hidden)
    out = target(None, layers=(L - 1, L), hidden_in=hidden[-1])
    return hidden + [out.hidden], out.logits


def exit_losses(adapter, target, w, positions=None):
    """w (B, T) windows -> {exit E: KL(p_target || q_draft of exit E), agree E: how often exit E's argmax
    equals the target's}. The loss to minimise is the sum over exits. positions (S,): use only these."""
    with torch.no_grad():
        hidden, logits = exit_hidden_states(target, w)
    if positions is not None:
        hidden, logits = [h[:, positions] for h in hidden], logits[:, positions]
    V = logits.size(-1)
    log_p_target = torch.log_softmax(logits.float(), dim=-1).reshape(-1, V)  # (B*S, V)
    losses = {}
    for E in range(1, target.config.n_layer):
        q_logits = exit_logits(target, adapter, E, hidden[E - 1]).float()  # (B, S, V)
        log_q_draft = torch.log_softmax(q_logits.reshape(-1, V), dim=-1)  # (B*S, V)
        losses[f"exit{E}"] = F.kl_div(log_q_draft, log_p_target, log_target=True, reduction="batchmean")
        losses[f"agree{E}"] = (q_logits.argmax(-1) == logits.argmax(-1)).float().mean()
    return losses


def mask_losses(drafter, target, w, anchors):
    """w (B, T+k) windows of text; the drafter reads the first T tokens with a group after each anchor (G,).
    Mask j (0-based) of the group at anchor a learns the target's argmax after x_0..x_{a+j} along the text.
    Returns {loss: cross-entropy, agree1..k: how often the drafter's top-1 is the target's, per mask}."""
    k = drafter.config.n_masks
    T = w.size(1) - k
    with torch.no_grad():  # the target is frozen: its choices are the data
        greedy = target(w[:, :T + k - 1]).logits.argmax(-1)  # (B, T+k-1) the target's token after each prefix
    logits = drafter(target, w[:, :T], anchors)  # (B, G, k, V)
    label_pos = torch.as_tensor(anchors, device=w.device)[:, None] + torch.arange(k, device=w.device)  # (G, k)
    labels = greedy[:, label_pos]  # (B, G, k)
    loss = F.cross_entropy(logits.flatten(0, 2), labels.flatten())
    agree = (logits.argmax(-1) == labels).float().mean((0, 1))  # (k,)
    return {"loss": loss, **{f"agree{j + 1}": agree[j] for j in range(k)}}
