"""Oracle for host/hearth/tests/api/pytorch_parity.rs: checks hearth's training steps one
by one against PyTorch, with the peer benchmark's GPT and torch.optim, and
exits non-zero when they disagree.

Every check is made at hearth's own state, so that no step inherits the
last one's rounding (teacher forcing). Comparing two whole float32 runs
cannot hold on every CPU: Adam divides each gradient by its own running
RMS, so a rounding difference of one unit in the last place in a gradient
that nearly cancels becomes a different step, and 20 steps later the two
runs part by far more than any rounding bound. How libtorch rounds depends
on the instructions it picks for the CPU (oneDNN's GELU is even a different
formula with AVX-512), so such a test encodes one machine.

1. Logits at init, and at each step the loss, the clipped gradients and
   their norm at hearth's weights, against float64 PyTorch at the same
   weights. Both float32 sides compute the same maths with algorithms of
   the same depth, so their distances from float64 are rounding of the same
   order on any CPU: hearth may be at most 4 times as far as float32
   PyTorch on this machine, plus 64 u (u = 2^-24) of the tensor's largest
   value. That floor covers Abramowitz-Stegun's erf in hearth's GELU (1.5e-7
   at most, about 1.3 u of each activation) and a float32 PyTorch that
   happens to round almost exactly. A wrong gradient (a missing mask, a
   wrong scale, a dropped term) is off by orders of magnitude more.
2. Each optimizer step from hearth's weights and hearth's gradients, with
   the optimizer's state built from hearth's earlier gradients: hearth's
   next weights against torch.optim's, element by element, within the sum
   of both sides' rounding bounds. The bound is a running error analysis in
   float64 of the step's elementwise operations (each rounds at most u of
   its result, a handful per element), carried through the moments'
   recursions; it does not depend on how either side vectorises.
"""
import copy
import json
import math
import pathlib
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402

U = 2.0**-24
RATIO = 4.0
FLOOR = 64 * U


def near_float64(failures, what, ours, fp32, exact):
    """hearth's `ours` within RATIO times float32 PyTorch's distance from
    float64 `exact`, plus FLOOR of exact's largest magnitude; returns the
    distance as a fraction of that."""
    ours, fp32, exact = (t.detach().double().cpu() for t in (ours, fp32, exact))
    err_ours = (ours - exact).abs().max().item()
    err_fp32 = (fp32 - exact).abs().max().item()
    allowed = RATIO * err_fp32 + FLOOR * exact.abs().max().item()
    if not err_ours <= allowed:
        failures.append(f"{what}: {err_ours:.3e} from float64, float32 PyTorch {err_fp32:.3e}, allowed {allowed:.3e}")
    return err_ours / allowed if allowed > 0 else 0.0


def loss_and_gradients(model, x, y, spec):
    """Loss, clip norm (or None) and gradients by name, as one training step
    computes them (clipped when the spec clips)."""
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    loss.backward()
    norm = None
    if spec["max_grad_norm"] is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"], spec.get("norm_type", 2.0))
    return loss.detach(), norm, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def load_weights(model, weights, device):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n].to(device=device, dtype=p.dtype))


class StepBound:
    """One side's rounding bound for one parameter's optimizer steps: the
    exact (float64) step from the same gradients, and how far a float32
    evaluation of it may be."""

    def __init__(self, group, kind):
        self.g, self.kind, self.t = group, kind, 0
        self.m = self.v = self.em = self.ev = None

    def step(self, p, grad):
        """Bound on |float32 p_new - exact p_new| for this step."""
        g, self.t = grad.double(), self.t + 1
        lr, wd = self.g["lr"], self.g["weight_decay"]
        if self.kind in ("adam", "adamw"):
            return self._adam(p, g, lr, wd)
        return self._sgd(p, g, lr, wd)

    def _adam(self, p, g, lr, wd):
        b1, b2 = self.g["betas"]
        eps = self.g["eps"]
        eg = torch.zeros_like(g)
        if self.kind == "adam" and wd:  # L2 decay: g + wd * p, two roundings
            g = g + wd * p
            eg = 2 * U * g.abs()
        if self.m is None:
            self.m, self.v = torch.zeros_like(g), torch.zeros_like(g)
            self.em, self.ev = torch.zeros_like(g), torch.zeros_like(g)
        # m = b1 m + (1 - b1) g and v = b2 v + (1 - b2) g^2, three
        # roundings each (of the products and the sum, or lerp's).
        self.em = b1 * self.em + (1 - b1) * eg + 3 * U * (self.m.abs() + g.abs())
        self.ev = b2 * self.ev + (1 - b2) * 2 * g.abs() * eg + 3 * U * (self.v + g * g)
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        mh, vh = self.m / bc1, self.v / bc2
        s = vh.sqrt()
        den = s + eps
        r = mh / den
        # sqrt's error: ev/(2 sqrt v) where v > 0, sqrt(ev) where v = 0.
        es = torch.where(s > 0, (self.ev / bc2) / (2 * s.clamp_min(1e-300)), (self.ev / bc2).sqrt())
        # The bias corrections, sqrt, + eps, the division and the scaling
        # by lr: six more roundings of r.
        er = (self.em / bc1) / den + mh.abs() * es / den**2 + 6 * U * r.abs()
        decay = lr * wd if self.kind == "adamw" else 0.0
        p_new = p * (1 - decay) - lr * r
        return lr * er + 3 * U * (p.abs() + p_new.abs())

    def _sgd(self, p, g, lr, wd):
        mu, damp, nesterov = self.g["momentum"], self.g["dampening"], self.g["nesterov"]
        eg = torch.zeros_like(g)
        if wd:
            g = g + wd * p
            eg = 2 * U * g.abs()
        d, ed = g, eg
        if mu:
            if self.m is None:
                self.m, self.em = g.clone(), eg.clone()
            else:
                self.em = mu * self.em + (1 - damp) * eg + 3 * U * (mu * self.m.abs() + g.abs())
                self.m = mu * self.m + (1 - damp) * g
            if nesterov:
                d = g + mu * self.m
                ed = eg + mu * self.em + 2 * U * d.abs()
            else:
                d, ed = self.m, self.em
        p_new = p - lr * d
        return lr * ed + 2 * U * (p_new.abs() + lr * d.abs())


def main(folder: pathlib.Path) -> int:
    spec = json.loads((folder / "spec.json").read_text())
    init = load_file(folder / "init.safetensors")
    after = load_file(folder / "after.safetensors")
    steps = load_file(folder / "steps.safetensors")
    io = load_file(folder / "io.safetensors")
    model = peer_gpt.build(spec["vocab_size"], spec["block_size"], spec["d_model"], spec["layers"], spec["heads"])
    model.load_state_dict(init, strict=True)  # same names, same shapes, or this raises
    # Replayed on the device hearth trained on; compared on the CPU.
    device = torch.device(spec.get("device", "cpu"))
    torch.set_default_device(device)  # the peer's GPT makes its positions with torch.arange
    model.to(device)
    exact = copy.deepcopy(model).double()
    names = [n for n, _ in model.named_parameters()]
    n_steps = spec["steps"]
    weights_at = [{n: steps[f"{k}/w/{n}"] for n in names} for k in range(n_steps)] + [after]
    failures = []

    x, y = io["inputs"].to(device), io["targets"].to(device)
    with torch.no_grad():
        worst_near = near_float64(failures, "logits at init", io["logits"], model(x), exact(x))

    # 1. Loss, norm and gradients at hearth's weights of each step.
    for k in range(n_steps):
        load_weights(model, weights_at[k], device)
        load_weights(exact, weights_at[k], device)
        loss32, norm32, grads32 = loss_and_gradients(model, x, y, spec)
        loss64, norm64, grads64 = loss_and_gradients(exact, x, y, spec)
        checks = [(f"loss at step {k}", io["losses"][k], loss32, loss64)]
        if norm64 is not None:
            checks.append((f"gradient norm at step {k}", io["norms"][k], norm32, norm64))
        checks += [(f"gradient of {n} at step {k}", steps[f"{k}/g/{n}"], grads32[n], grads64[n]) for n in names]
        for check in checks:
            worst_near = max(worst_near, near_float64(failures, *check))

    # 2. Each optimizer step from hearth's weights and gradients.
    o = spec["optimizer"]
    params = list(model.parameters())
    if "groups" in o:
        # Each group takes the parameters whose name contains one of its
        # "match" strings ("" matches all) and none of its "exclude" ones.
        def members(g):
            match = g["match"] if isinstance(g["match"], list) else [g["match"]]
            return [p for n, p in sorted(model.named_parameters()) if any(m in n for m in match) and not any(x in n for x in g.get("exclude", []))]

        params = [{"params": members(g), **{k: g[k] for k in ("lr", "weight_decay") if k in g}} for g in o["groups"]]
    if o["kind"] in ("adamw", "adam"):
        cls = torch.optim.AdamW if o["kind"] == "adamw" else torch.optim.Adam
        opt = cls(params, lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"], eps=o["eps"])
    else:
        opt = torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], dampening=o["dampening"], weight_decay=o["weight_decay"], nesterov=o["nesterov"])
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    by_name = dict(model.named_parameters())
    bounds = {n: StepBound(group_of[id(by_name[n])], o["kind"]) for n in names}
    worst = 0.0
    for k in range(n_steps):
        load_weights(model, weights_at[k], device)
        for n, p in by_name.items():
            p.grad = steps[f"{k}/g/{n}"].to(device)
        opt.step()
        for n, p in by_name.items():
            w = weights_at[k][n].double()
            allowed = bounds[n].step(w, steps[f"{k}/g/{n}"])
            ours = weights_at[k + 1][n].double()
            theirs = p.detach().double().cpu()
            # Both sides' bounds; 1e-30 for exact zeros on both.
            excess = (ours - theirs).abs() - 2 * allowed
            if excess.max().item() > 1e-30:
                at = excess.argmax().item()
                failures.append(
                    f"step {k}, {n}: hearth {ours.flatten()[at].item():.9g} against torch.optim {theirs.flatten()[at].item():.9g}, "
                    f"allowed {2 * allowed.flatten()[at].item():.3e}"
                )
            ratio = ((ours - theirs).abs() / (2 * allowed).clamp_min(1e-300)).max().item()
            worst = max(worst, ratio if math.isfinite(ratio) else 0.0)
    if failures:
        print("\n".join(failures[:40]))
        return 1
    print(
        f"hearth and PyTorch agree: logits, {n_steps} losses, {len(io['norms'])} norms and {n_steps} x {len(names)} gradients "
        f"near float64 (worst {worst_near:.3f} of the allowance), {n_steps} optimizer steps (worst {worst:.3f} of the rounding bound)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
