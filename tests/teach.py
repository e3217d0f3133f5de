"""Assertions that teach, for the graded tests: each failure says in words which function, which law or case,
what was expected and what came. The autograder prints that message; `python -m pytest -m exN -x` shows all.
Not a test file: it holds no tests."""
import torch


def show(x, digits=4):
    """A short, readable value: tensors as nested lists rounded to `digits`, long ones cut."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.is_floating_point():
            x = torch.round(x, decimals=digits)
        text = str(x.tolist())
    else:
        text = repr(x)
    return text if len(text) <= 160 else text[:150] + " ..."


def expect(ok, message):
    """assert ok, with the message as the whole failure (pytest still shows the values under -x)."""
    if not ok:
        raise AssertionError(message)


def expect_equal(got, expected, what):
    expect(got == expected, f"{what}: expected {show(expected)}, got {show(got)}")


def expect_close(got, expected, what, atol=1e-12):
    """Tensors (or numbers) equal within atol, same shape; NaN never passes."""
    got_t, exp_t = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if got_t.shape != exp_t.shape:
        raise AssertionError(f"{what}: expected shape {tuple(exp_t.shape)}, got {tuple(got_t.shape)}")
    if not torch.isfinite(got_t).all():
        raise AssertionError(f"{what}: got NaN or inf: {show(got_t)} (expected {show(exp_t)})")
    if not torch.allclose(got_t, exp_t, rtol=0, atol=atol):
        worst = (got_t - exp_t).abs().max().item()
        raise AssertionError(f"{what}: expected {show(exp_t)}, got {show(got_t)} (off by up to {worst:.3g})")


def expect_law(distance, bound, what, got=None, expected=None):
    """A sampled law within its total-variation bound (the bound is wrong with probability < 1e-6)."""
    if not distance < bound:
        values = f"; sampled {show(got)}, exact {show(expected)}" if got is not None else ""
        raise AssertionError(f"{what}: total variation {distance:.4f} from the exact law, over the bound "
                             f"{bound:.4f} (a correct sampler exceeds it with probability < 1e-6){values}")
