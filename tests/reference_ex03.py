"""The course's own copy of exercise 3 (`accept_prob` and `residual`), written the slow, plain way.

Later exercises' graded tests (4 and 13) put these in place of nanospec/rules/verify.py's, so that each exercise is
graded alone: a gap in exercise 3 costs no points in exercise 4. A handout that blanks exercise 3 leaves this
file out (it IS the answer); there the tests of 4 and 13 use your own exercise 3, and the course's grader,
which runs the full project's tests, brings this file back. Not a graded test file: it holds no tests."""
import torch


def slow_accept_prob(p, q, x):
    """min(1, p(x) / q(x)), and, where q(x) = 0, 1 if p(x) > 0 else 0. p, q (..., V); x (...) -> (...)."""
    px = torch.take_along_dim(p, x[..., None], dim=-1)[..., 0]
    qx = torch.take_along_dim(q, x[..., None], dim=-1)[..., 0]
    out = (px > 0).to(p.dtype)  # the q(x) = 0 convention, overwritten below where q(x) > 0
    drawable = qx > 0
    out[drawable] = torch.clamp(px[drawable] / qx[drawable], max=1.0)
    return out


def slow_residual(p, q):
    """max(0, p - q) normalised, row by row, or p where that leaves nothing. p, q (..., V) -> (..., V)."""
    left = torch.relu(p - q)
    total = left.sum(-1, keepdim=True)
    return torch.where(total > 0, left / torch.where(total > 0, total, 1.0), p)
